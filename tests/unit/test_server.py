"""The daemon's start: its token (written once, 0600, reused), its socket and its file modes.

The last tests run the real ``serve()`` in a process of its own (it sets the
process umask and binds sockets) over the fake VM driver, started with a
permissive umask 022, and look at what it left on disk.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.client import Controller
from forkd.controller import server
from forkd.errors import ForkdError
from forkd.launcher import free_port
from tests.unit.fakes import make_image

REPO = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """Umask 000 for the test: modes below come from forkd, not from the test's umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


# ------------------------------------------------------------------ the token


def test_first_start_writes_a_random_token_0600_and_later_starts_reuse_it(
    tmp_path: Path, loose_umask: None
) -> None:
    token = server.ensure_token(tmp_path)
    path = tmp_path / "token"
    assert path.read_text() == token + "\n"
    assert mode(path) == 0o600
    assert len(token) == 43 and token.replace("-", "").replace("_", "").isalnum()
    assert server.ensure_token(tmp_path) == token  # a restart keeps it
    assert path.read_text() == token + "\n"
    other = tmp_path / "other"
    other.mkdir()
    assert server.ensure_token(other) != token  # random, not derived from anything
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "token"]  # no temp file left


def test_an_existing_token_is_never_replaced_only_narrowed(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("chosen-by-the-operator\n")
    path.chmod(0o644)
    assert server.ensure_token(tmp_path) == "chosen-by-the-operator"
    assert path.read_text() == "chosen-by-the-operator\n"
    assert mode(path) == 0o600


def test_an_empty_token_file_stops_the_start_and_stays(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ForkdError, match="is empty"):
        server.ensure_token(tmp_path)
    assert (tmp_path / "token").read_text() == "\n"


def test_a_token_written_by_another_start_meanwhile_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two first starts race: the other one publishes its token while this one writes."""
    real = secrets.token_urlsafe

    def other_start_finishes_first(nbytes: int) -> str:
        (tmp_path / "token").write_text("the-other-start\n")
        return real(nbytes)

    monkeypatch.setattr("forkd.controller.server.secrets.token_urlsafe", other_start_finishes_first)
    assert server.ensure_token(tmp_path) == "the-other-start"
    assert (tmp_path / "token").read_text() == "the-other-start\n"  # not overwritten
    assert [p.name for p in tmp_path.iterdir()] == ["token"]


def _first_start(state: Path, barrier: Any, tokens: Any) -> None:
    barrier.wait()
    tokens.put(server.ensure_token(state))


def test_concurrent_first_starts_agree_on_one_token(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    n = 8
    for round_ in range(5):
        state = tmp_path / str(round_)
        state.mkdir()
        barrier, queue = ctx.Barrier(n), ctx.Queue()
        starts = [ctx.Process(target=_first_start, args=(state, barrier, queue)) for _ in range(n)]
        for p in starts:
            p.start()
        tokens = [queue.get(timeout=30) for _ in starts]
        for p in starts:
            p.join(30)
            assert p.exitcode == 0
        assert len(set(tokens)) == 1
        assert (state / "token").read_text() == tokens[0] + "\n"
        assert [p.name for p in state.iterdir()] == ["token"]


def test_token_file_wins_and_insecure_no_auth_is_the_only_way_to_no_token(
    tmp_path: Path,
) -> None:
    given = tmp_path / "given"
    given.write_text("from-the-flag\n")
    state = tmp_path / "state"
    state.mkdir()
    assert server.choose_token(state, given, insecure_no_auth=False) == "from-the-flag"
    assert not (state / "token").exists()
    assert server.choose_token(state, None, insecure_no_auth=True) is None
    assert not (state / "token").exists()
    with pytest.raises(ForkdError, match="contradict"):
        server.choose_token(state, given, insecure_no_auth=True)
    token = server.choose_token(state, None, insecure_no_auth=False)  # the default: auth on
    assert token and (state / "token").read_text() == token + "\n"


# ------------------------------------------------------------------ directories and socket


def test_state_directories_are_made_and_narrowed_to_0700(tmp_path: Path, loose_umask: None) -> None:
    made = tmp_path / "a" / "b"
    server.owner_only_dir(made)
    assert mode(made) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    server.owner_only_dir(old)
    assert mode(old) == 0o700


def test_a_shared_sticky_directory_is_refused_not_closed(tmp_path: Path) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: forkd --state-dir /tmp must not lock everyone out
    with pytest.raises(ForkdError, match="sticky"):
        server.owner_only_dir(shared)
    assert mode(shared) == 0o1777


def test_the_unix_socket_is_0600_whatever_the_umask(tmp_path: Path, loose_umask: None) -> None:
    path = tmp_path / "forkd.sock"
    with server.bind_unix_socket(path):
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert mode(path) == 0o600
    assert os.umask(0) == 0  # the umask of the caller is left as it was


def test_a_stale_socket_is_replaced_but_a_live_one_or_a_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "forkd.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # a daemon that died: nothing listens
    with server.bind_unix_socket(path) as live:
        live.listen()
        with pytest.raises(ForkdError, match="already listens"):
            server.bind_unix_socket(path)
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(ForkdError, match="not a unix socket"):
        server.bind_unix_socket(precious)
    assert precious.read_text() == "keep me"


# ------------------------------------------------------------------ a daemon process

SERVE = """
import os, sys
from pathlib import Path
os.umask(0o022)  # what a shell gives: the daemon must narrow it itself
from forkd.controller.server import E2BPort, serve
from forkd.controller.settings import Settings
from tests.unit.fakes import FakeDriver
state = Path(sys.argv[1])
settings = Settings(state_dir=state, snapshot_root=state / "snapshots", run_dir=state / "run",
                    pool_size=0)
e2b = E2BPort(sys.argv[3]) if len(sys.argv) > 3 else None
serve(settings, sys.argv[2], driver=FakeDriver(), log_level="warning", e2b=e2b)
"""


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``serve()`` in a process of its own on a unix socket: (state dir, socket)."""
    cache = tmp_path / "cache"
    make_image(cache)
    state, sock = tmp_path / "state", tmp_path / "d.sock"
    env = {**os.environ, "FORKD_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    env.pop("FORKD_TOKEN_FILE", None)
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(state), f"unix:{sock}"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=1) as c:
            while True:
                assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
                try:
                    if c.get("http://forkd/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the daemon did not start"
                time.sleep(0.05)
        yield state, sock
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()


@pytest.mark.skipif(
    shutil.which("mkfs.ext4") is None or shutil.which("qemu-img") is None,
    reason="volumes need mkfs.ext4 and qemu-img",
)
def test_a_daemon_keeps_its_files_to_its_user(
    fake_daemon: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, sock = fake_daemon
    assert mode(sock) == 0o600
    assert mode(state / "token") == 0o600
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as anon:
        assert anon.get("http://forkd/v1/snapshots").status_code == 401  # auth is on

    # A local client finds the token by itself, given only the state directory.
    for var in ("FORKD_URL", "FORKD_TOKEN", "FORKD_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FORKD_STATE_DIR", str(state))
    with Controller(f"unix:{sock}") as ctl:
        ctl.create_volume("data", "16M")
        ctl.create_snapshot("py", memory_mib=128, volumes=[{"name": "data", "path": "/data"}])
        [child] = ctl.spawn_sandboxes("py")
        branch = ctl.branch_sandbox(child["id"], tag="br")
        ctl.spawn_sandboxes(branch["tag"])
        ctl.write_file(child["id"], "/work/x", "y")

    seen = {p.relative_to(state).as_posix(): p for p in state.rglob("*")}
    for must in (
        "forkd.db",
        "audit.log",
        "token",
        "snapshots/py/memory.bin",
        "snapshots/py/snapshot.json",
        "snapshots/br/vmstate",
        "volumes/data/base.img",
        "volumes/data/volume.json",
    ):
        assert must in seen, sorted(seen)
    assert any(name.startswith("volumes/data/layers/") for name in seen)
    assert mode(state) == 0o700
    wider = {
        name: oct(mode(p))
        for name, p in seen.items()
        if mode(p) != (0o700 if p.is_dir() and not p.is_symlink() else 0o600)
    }
    assert wider == {}


def test_the_e2b_port_serves_beside_the_daemon_and_one_sigterm_ends_both(tmp_path: Path) -> None:
    """``--e2b-bind``: a second port, E2B's API over the same daemon; SIGTERM stops the
    E2B port, then the daemon, and the process exits cleanly."""
    cache = tmp_path / "cache"
    make_image(cache)
    state, sock = tmp_path / "state", tmp_path / "d.sock"
    port = free_port()
    env = {**os.environ, "FORKD_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    log = (tmp_path / "daemon.log").open("wb")
    argv = [sys.executable, "-c", SERVE, str(state), f"unix:{sock}", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
            try:
                token = (state / "token").read_text().strip()
                listed = httpx.get(
                    f"http://127.0.0.1:{port}/v2/sandboxes", headers={"X-API-KEY": token}
                )
                if listed.status_code == 200:
                    break
            except (OSError, httpx.TransportError):
                pass
            assert time.monotonic() < deadline, "the E2B port did not start"
            time.sleep(0.05)
        assert listed.json() == []
        wrong = httpx.get(f"http://127.0.0.1:{port}/v2/sandboxes", headers={"X-API-KEY": "no"})
        assert wrong.status_code == 401 and wrong.json()["code"] == 401
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as c:
            assert c.get("http://forkd/healthz").status_code == 200  # the daemon's own port
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        log.close()
    # uvicorn hands SIGTERM on once it has shut down (the E2B port's server to the
    # daemon's, the daemon's to the default): a clean stop ends by that signal.
    assert code == -signal.SIGTERM, (tmp_path / "daemon.log").read_text()
    assert b"Traceback" not in (tmp_path / "daemon.log").read_bytes()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/v2/sandboxes")
