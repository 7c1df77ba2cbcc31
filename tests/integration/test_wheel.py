"""The package as users get it: an sdist built from this tree and a wheel built from
the sdist, the wheel installed alone into a fresh virtualenv (only its own dependencies
from the package index), and its ``forkd`` command run against the suite's daemon:
--help, ps, fork. The server verbs say they need the server extra."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd.client import Controller

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # No --sdist/--wheel: build makes the sdist, then the wheel from the sdist, so the
    # wheel's test below is the sdist's too.
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


@pytest.fixture(scope="module")
def client_venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = dist.glob("forkd-*.whl")
    subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    yield venv


def _forkd(
    venv: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "forkd"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=venv,
        env={"PATH": "/usr/bin:/bin", "HOME": str(venv), **(env or {})},
    )


def test_the_sdist_carries_the_guest_files(dist: Path) -> None:
    (sdist,) = dist.glob("forkd-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {Path(n).as_posix().split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert "src/forkd/guest/files/forkd-agent.py" in names
    assert "pyproject.toml" in names and "README.md" in names


def test_the_wheel_alone_is_a_working_client(
    client_venv: Path, daemon: Any, api_template: str, tmp_path: Path
) -> None:
    python = client_venv / "bin" / "python"
    installed = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u; print([m for m in "
            "('fastapi', 'uvicorn', 'qemu', 'pyroute2') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert installed.stdout.strip() == "[]"  # the client needs none of the server's parts
    assert _forkd(client_venv, "--help").returncode == 0

    serve = _forkd(client_venv, "serve")
    assert serve.returncode == 1
    assert serve.stderr.strip() == "forkd serve needs the server extra: pip install 'forkd[server]'"

    token = tmp_path / "token"
    token.write_text(daemon.token)
    env = {"FORKD_URL": daemon.url, "FORKD_TOKEN_FILE": str(token)}
    ps = _forkd(client_venv, "ps", "--json", env=env)
    assert ps.returncode == 0, ps.stderr
    assert isinstance(json.loads(ps.stdout), list)
    fork = _forkd(client_venv, "fork", "--tag", api_template, "--json", env=env)
    assert fork.returncode == 0, fork.stderr
    (child,) = json.loads(fork.stdout)
    with Controller(daemon.url, token=daemon.token) as ctl:
        try:
            assert ctl.get_sandbox(child["id"])["state"] == "running"
        finally:
            ctl.kill_sandbox(child["id"])
