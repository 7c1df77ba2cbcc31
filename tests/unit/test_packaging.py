"""packaging/forkd.service is a unit systemd accepts, and keeps the sandboxes alive
across a restart of the service; pyproject.toml's license has the form that keeps
building after setuptools drops the table form (2027-02-18), so an install prints no
deprecation wall."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "packaging" / "forkd.service"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_the_unit_runs_the_daemon_and_spares_its_sandboxes() -> None:
    unit = _settings()
    assert unit["ExecStart"][0].split()[1] == "serve"
    assert unit["KillMode"] == ["process"]  # a restart must not kill the sandboxes
    assert "MemoryDenyWriteExecute" not in unit  # TCG writes and runs code


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    exe = _settings()["ExecStart"][0].split()[0]
    copy = tmp_path / "forkd.service"  # its ExecStart exists only once installed
    copy.write_text(UNIT.read_text().replace(exe, shutil.which("true") or "/bin/true"))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stderr.strip(), (exe, result.stderr)


def test_the_license_is_an_spdx_expression_and_setuptools_reads_it() -> None:
    meta = tomllib.loads(PYPROJECT.read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # not {text = ...}: deprecated
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)", setuptools)
    assert floor and int(floor[1]) >= 77, setuptools  # the first to read PEP 639's form
