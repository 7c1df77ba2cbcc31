"""packaging/forkd.service is a unit systemd accepts, and keeps the sandboxes alive
across a restart of the service."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "packaging" / "forkd.service"


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
