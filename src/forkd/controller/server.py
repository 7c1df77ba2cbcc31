"""Run the daemon: one per state directory, on TCP or a unix socket."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import uvicorn

from forkd.controller.app import create_app
from forkd.controller.settings import Settings
from forkd.errors import ForkdError


def parse_bind(bind: str) -> dict[str, object]:
    """``host:port``, ``:port`` or ``unix:/path/to.sock`` → uvicorn arguments."""
    if bind.startswith("unix:"):
        path = bind[len("unix:") :]
        if not path.startswith("/"):
            raise ForkdError(f"unix socket path must be absolute: {bind!r}")
        return {"uds": path}
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ForkdError(f"--bind must be HOST:PORT or unix:/path, not {bind!r}")
    return {"host": host.strip("[]") or "127.0.0.1", "port": int(port)}


def read_token(token_file: Path | None) -> str | None:
    if token_file is None:
        return None
    try:
        token = token_file.read_text().strip()
    except OSError as exc:
        raise ForkdError(f"cannot read the token file {token_file}: {exc}") from exc
    if not token:
        raise ForkdError(f"the token file {token_file} is empty")
    return token


def lock_state_dir(state_dir: Path) -> int:
    """Hold an exclusive lock so two daemons never own the same VMs."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "forkd.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise ForkdError(f"another forkd daemon is using {state_dir}") from exc
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def serve(settings: Settings, bind: str, token_file: Path | None, log_level: str = "info") -> None:
    where = parse_bind(bind)
    token = read_token(token_file)
    lock_fd = lock_state_dir(settings.state_dir)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if "uds" in where:
            Path(str(where["uds"])).unlink(missing_ok=True)
        config = uvicorn.Config(
            create_app(settings, token),
            log_level=log_level,
            timeout_graceful_shutdown=30,
            access_log=False,
            **where,  # type: ignore[arg-type]
        )
        uvicorn.Server(config).run()
    finally:
        os.close(lock_fd)
