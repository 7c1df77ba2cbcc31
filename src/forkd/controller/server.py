"""Run the daemon: one per state directory, on TCP or a unix socket, owner-only on disk.

Auth is on unless asked off: the token comes from ``--token-file``, else from
``<state-dir>/token``, written (random, mode 0600) on the first start. The
daemon runs under umask 077, so every file it and its QEMU processes create
is readable by its user only, and a unix socket it listens on is mode 0600.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import signal
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import uvicorn
from fastapi import FastAPI

from forkd import paths
from forkd.controller import log_redaction, port_ws
from forkd.controller.app import create_app, end_streams
from forkd.controller.connection_limits import ConnectionLimiter, uvicorn_options
from forkd.controller.services.launcher import VMDriver
from forkd.controller.settings import Settings
from forkd.errors import ForkdError

log = logging.getLogger(__name__)

# Files the daemon creates are 0600 and its directories 0700, whatever the
# mode a caller asks for (QEMU, qemu-img, mkfs and SQLite choose their own).
OWNER_ONLY_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600
SOCKET_MODE = 0o600
TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 43 characters, 256 bits

INSECURE_WARNING = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!! AUTH IS OFF (--insecure-no-auth), listening on {where} (clients send no token).
!! Every route answers anyone who reaches it: any local user, and any process
!! or sandbox that can connect, can fork VMs and run code in every sandbox.
!! Drop the flag to use the token in {token}.
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"""


class Server(uvicorn.Server):
    """uvicorn's server, which ends the app's event streams as it starts to shut down:
    it waits for every open connection to close before it ends the app's lifespan."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if isinstance(self.config.app, FastAPI):
            end_streams(self.config.app)
        await super().shutdown(sockets)


class Bind(TypedDict, total=False):
    """Where the server listens, as ``uvicorn.Config`` takes it: ``uds``, or ``host``
    and ``port``."""

    uds: str
    host: str
    port: int


def parse_bind(bind: str) -> Bind:
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


def listening_url(where: Bind) -> str:
    """Where clients reach the daemon (``FORKD_URL``): ``http://HOST:PORT`` or ``unix:PATH``."""
    if "uds" in where:
        return f"unix:{where['uds']}"
    host = where["host"]
    return f"http://[{host}]:{where['port']}" if ":" in host else f"http://{host}:{where['port']}"


def configure_logging(log_level: str) -> None:
    """The log format of the daemon and the gateway, at ``log_level``."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per registry or node request (a push makes hundreds): only when debugging.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_state_token(path: Path) -> str:
    """The token in ``path``, made 0600 if an older forkd or a person left it wider."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("%s was mode %04o; making it %04o", path, mode, FILE_MODE)
        path.chmod(FILE_MODE)
    token = read_token(path)
    assert token is not None
    return token


def ensure_token(state_dir: Path) -> str:
    """The daemon's token: ``<state_dir>/token``, written on the first start and kept.

    A new token is written whole to a temporary name (``O_EXCL``, mode 0600)
    and then hard-linked to ``token``: unlike a rename, a link never replaces
    a file already there, so two daemons starting at once (or a daemon and a
    person writing the file) end with one token, and both use it.
    """
    path = paths.token_file(state_dir)
    with contextlib.suppress(FileNotFoundError):
        return _read_state_token(path)
    tmp = path.with_name(f".token.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            log.info("wrote a new token to %s (mode 0600); local clients read it there", path)
        except FileExistsError:
            pass  # another start wrote one first: use that
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(state_dir)
    return _read_state_token(path)


def choose_token(state_dir: Path, token_file: Path | None, insecure_no_auth: bool) -> str | None:
    """The token every request must carry; None only with ``insecure_no_auth``."""
    if token_file is not None and insecure_no_auth:
        raise ForkdError("--token-file and --insecure-no-auth contradict each other; pick one")
    if token_file is not None:
        return read_token(token_file)
    if insecure_no_auth:
        return None
    return ensure_token(state_dir)


def owner_only_dir(path: Path) -> None:
    """Create ``path`` (mode 0700), or make an existing one 0700.

    A sticky directory (``/tmp``, ``/var/tmp``) is shared by design: it is
    refused rather than closed to everyone else.
    """
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & stat.S_ISVTX:
        raise ForkdError(f"{path} is a shared directory (sticky bit); give forkd one of its own")
    if mode != DIR_MODE:
        log.info("%s was mode %04o; making it %04o", path, mode, DIR_MODE)
        path.chmod(DIR_MODE)


def lock_state_dir(state_dir: Path) -> int:
    """Hold an exclusive lock so two daemons never own the same VMs."""
    owner_only_dir(state_dir)
    fd = os.open(state_dir / "forkd.lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise ForkdError(f"another forkd daemon is using {state_dir}") from exc
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket a previous daemon left at ``path``; refuse anything else."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ForkdError(f"{path} exists and is not a unix socket; not removing it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # nobody listens: left by a daemon that died
            return
    raise ForkdError(f"something already listens on {path}")


def bind_unix_socket(path: Path) -> socket.socket:
    """A unix socket bound at ``path``, mode 0600, never wider on the way.

    uvicorn's own ``uds`` binding chmods the socket to 0666 after creating it,
    so the daemon binds it here and hands it over. Bound under the daemon's
    umask 077 it is born 0700 (owner only) and is then narrowed to exactly 0600.
    """
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with owner_only_umask():
            sock.bind(str(path))
        path.chmod(SOCKET_MODE)
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def owner_only_umask() -> Iterator[None]:
    """Run the block under umask 077 (the whole daemon runs under it)."""
    old = os.umask(OWNER_ONLY_UMASK)
    try:
        yield
    finally:
        os.umask(old)


MAX_OPEN_FILES = 1 << 20


def raise_open_file_limit() -> None:
    """The soft limit of open descriptors up to the hard one (the egress proxy holds two
    a guest connection, every sandbox's QEMU several): what a service manager allows,
    this daemon uses, as Go's runtime does for its programs."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open file limit from %d: %s", soft, exc)


def serve(
    settings: Settings,
    bind: str,
    token_file: Path | None = None,
    log_level: str = "info",
    *,
    insecure_no_auth: bool = False,
    driver: VMDriver | None = None,
    e2b: E2BPort | None = None,
) -> None:
    """Run the daemon until SIGTERM or SIGINT. ``driver`` replaces QEMU (tests only);
    ``e2b``: where and how E2B's API is served too (:mod:`forkd.controller.e2b`)."""
    configure_logging(log_level)
    raise_open_file_limit()
    where = parse_bind(bind)
    with owner_only_umask():
        lock_fd = lock_state_dir(settings.state_dir)
        sock: socket.socket | None = None
        try:
            token = choose_token(settings.state_dir, token_file, insecure_no_auth)
            for d in (settings.snapshot_root, settings.run_dir):
                owner_only_dir(d)
            if token is None:
                log.warning(
                    INSECURE_WARNING.format(
                        where=listening_url(where), token=paths.token_file(settings.state_dir)
                    )
                )
            sockets = None
            if "uds" in where:
                # Left in place at exit, like uvicorn's (which re-raises SIGTERM after
                # its shutdown); the next start removes it once nothing listens on it.
                path = Path(where.pop("uds"))
                sock = bind_unix_socket(path)
                sockets = [sock]
                log.info("listening on unix socket %s (mode 0600)", path)
            connections = ConnectionLimiter(settings.connection_limits, owner_token=token)
            app = create_app(settings, token, driver=driver, connections=connections)
            config = _uvicorn_config(app, log_level, connections, where)
            if settings.registry_policy is not None:  # SIGHUP: read the policy file again
                policy = settings.registry_policy
                signal.signal(signal.SIGHUP, lambda _sig, _frame: policy.reload_now())
            servers: list[uvicorn.Server] = [Server(config)]
            if e2b is not None:
                servers.append(_e2b_server(app, token, settings, log_level, connections, e2b))
            asyncio.run(_serve_all(servers, sockets))
        finally:
            if sock is not None:
                sock.close()
            os.close(lock_fd)


@dataclass(frozen=True)
class E2BPort:
    """``forkd serve --e2b-bind``: where E2B's API is served, the domain of its sandboxes'
    ports (``--e2b-domain``) and whether they take no traffic token."""

    bind: str
    domain: str | None = None
    public_ports: bool = False


def _e2b_server(
    daemon: FastAPI,
    token: str | None,
    settings: Settings,
    log_level: str,
    connections: ConnectionLimiter,
    port: E2BPort,
) -> uvicorn.Server:
    """E2B's API on a port of its own, over the daemon's services (no lifespan of its
    own: the daemon's starts and stops them)."""
    from forkd.controller.e2b.app import create_e2b_app
    from forkd.controller.e2b.builds import Builds

    where = parse_bind(port.bind)
    if "uds" in where:
        raise ForkdError("--e2b-bind takes HOST:PORT: E2B's SDKs speak TCP")
    domain = port.domain or f"localhost:{where['port']}"
    e2b = create_e2b_app(
        daemon,
        token,
        settings.max_upload_bytes,
        domain=domain,
        public_ports=port.public_ports,
        builds=Builds.in_state_dir(settings, settings.max_upload_bytes),
    )
    telemetry = getattr(daemon.state, "telemetry", None)
    if telemetry is not None:
        telemetry.instrument(e2b)
    config = _uvicorn_config(e2b, log_level, connections, where)
    config.lifespan = "off"
    log.info("E2B's API on %s", listening_url(where))
    return uvicorn.Server(config)


async def _serve_all(servers: list[uvicorn.Server], sockets: list[socket.socket] | None) -> None:
    """The daemon's server and the E2B port's, in one event loop. Each catches SIGTERM in
    turn: the last started stops first, then hands the signal on to the one before."""
    first, *others = servers
    started = [asyncio.create_task(first.serve(sockets=sockets))]
    for server in others:
        while not (first.started or started[0].done()):
            await asyncio.sleep(0.05)
        started.append(asyncio.create_task(server.serve()))
    await asyncio.gather(*started)


def _uvicorn_config(
    app: FastAPI, log_level: str, connections: ConnectionLimiter, where: Bind
) -> uvicorn.Config:
    """How uvicorn serves the daemon's ``app`` (``where``: a host and port, or nothing
    when the daemon hands it a unix socket of its own)."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=30,
        access_log=False,
        # X-Forwarded-For from a local client would otherwise stand for its
        # address in the audit log and in what a guest's port sees.
        proxy_headers=False,
        # WebSockets (terminals, guest ports, tunnels): what the daemon holds of
        # a peer that sends faster than the other side reads is bounded.
        ws_max_size=port_ws.MAX_MESSAGE_BYTES,
        ws_max_queue=port_ws.WS_QUEUE,
        # A request head or body that does not come in time, and connections
        # over the caps, are closed: no local process can pile them up.
        **uvicorn_options(connections),
        **where,
    )
    log_redaction.install("uvicorn", "uvicorn.error", "uvicorn.access")  # set up by Config
    return config
