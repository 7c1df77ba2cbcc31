"""Auth is on by default: a real ``forkd serve`` with no token options, and its file modes."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkd.launcher import DaemonProcess

from .conftest import Daemon

pytestmark = pytest.mark.integration


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="forkd-auth-", dir="/tmp"))  # short: unix socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def started() -> Iterator[list[DaemonProcess]]:
    """Daemons a test starts; each is stopped at the end."""
    daemons: list[DaemonProcess] = []
    yield daemons
    for d in daemons:
        d.stop()


def start(started: list[DaemonProcess], state: Path, bind: str | None = None) -> DaemonProcess:
    d = DaemonProcess(state, bind=bind)
    started.append(d)
    d.start("--kill-on-exit")
    return d


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``forkd ARGS`` with only ``env`` telling it where the daemon and its token are."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FORKD_")}
    argv = [sys.executable, "-m", "forkd.cli", *args]
    return subprocess.run(argv, env={**base, **env}, capture_output=True, text=True, timeout=120)


def test_a_daemon_with_no_token_options_needs_the_token_it_wrote(
    root: Path, started: list[DaemonProcess]
) -> None:
    state = root / "state"
    d = start(started, state)  # free port on 127.0.0.1, no --token-file
    token_file = state / "token"
    assert d.token_path == token_file and mode(token_file) == 0o600 and mode(state) == 0o700
    token = token_file.read_text().strip()
    assert len(token) >= 43

    with httpx.Client(base_url=d.url, timeout=30) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/v1/snapshots").status_code == 401
        assert c.get("/v1/snapshots", headers={"Authorization": "Bearer guess"}).status_code == 401
        ok = c.get("/v1/snapshots", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json() == []

    # The CLI finds the token with nothing but the state directory to go on.
    res = cli("ps", "--json", FORKD_URL=d.url, FORKD_STATE_DIR=str(state))
    assert res.returncode == 0, res.stderr
    res = cli("ps", "--json", FORKD_URL=d.url, FORKD_STATE_DIR=str(root / "elsewhere"))
    assert res.returncode == 1 and "bearer token" in res.stderr

    d.stop()  # a restart keeps the token
    d.start("--kill-on-exit")
    assert token_file.read_text().strip() == token
    with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {token}"}) as c:
        assert c.get("/v1/snapshots").status_code == 200


def test_a_unix_socket_is_0600_and_needs_the_token(
    root: Path, started: list[DaemonProcess]
) -> None:
    sock = root / "forkd.sock"
    d = start(started, root / "state", bind=f"unix:{sock}")
    assert stat.S_ISSOCK(sock.lstat().st_mode) and mode(sock) == 0o600
    token = d.token
    assert token
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://forkd") as c:
        assert c.get("/v1/snapshots").status_code == 401
        ok = c.get("/v1/snapshots", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200
    res = cli("ps", "--json", FORKD_URL=f"unix:{sock}", FORKD_STATE_DIR=str(root / "state"))
    assert res.returncode == 0, res.stderr


def test_insecure_no_auth_is_explicit_and_loud(root: Path, started: list[DaemonProcess]) -> None:
    d = DaemonProcess(root / "state")
    started.append(d)
    d.start("--insecure-no-auth")
    with httpx.Client(base_url=d.url) as c:
        assert c.get("/v1/snapshots").status_code == 200
    assert "AUTH IS OFF" in d.log_tail(5000)
    assert f"listening on {d.url} (clients send no token)" in d.log_tail(5000)
    assert not (root / "state" / "token").exists()


def test_snapshot_and_runtime_files_are_the_daemon_users_only(
    daemon: Daemon, api_template: str
) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=300) as c:
        r = c.post("/v1/sandboxes", json={"snapshot_tag": api_template, "n": 1})
        assert r.status_code == 201, r.text
        sid = r.json()[0]["id"]
        try:
            snap = daemon.state_dir / "snapshots" / api_template
            files = {p.name: mode(p) for p in snap.iterdir()}
            assert {"memory.bin", "vmstate", "snapshot.json"} <= files.keys()
            assert files == dict.fromkeys(files, 0o600)
            assert mode(snap) == 0o700
            for d in (daemon.state_dir, daemon.state_dir / "snapshots", daemon.state_dir / "run"):
                assert mode(d) == 0o700, d
            for name in ("forkd.db", "audit.log", "forkd.lock"):
                assert mode(daemon.state_dir / name) == 0o600, name
            # What QEMU and the daemon made for the running child: RAM file, vm.json,
            # logs, QMP and agent sockets. None is open to group or others.
            run = daemon.state_dir / "run" / sid
            opened = {p.name: oct(mode(p)) for p in run.iterdir() if mode(p) & 0o077}
            assert opened == {} and mode(run) == 0o700
        finally:
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
