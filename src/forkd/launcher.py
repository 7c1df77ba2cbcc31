"""Starting a ``forkd serve`` process and waiting until it answers ``/healthz``.

Like the SDK it imports only the standard library and httpx. The demo starts
its daemon here when none answers, and so do the integration tests.

The daemon's token is the file given as ``token_file`` (passed as
``--token-file``) or else the one the daemon writes on its first start,
``<state_dir>/token``: :attr:`DaemonProcess.token_path` names whichever it is.

Example::

    d = DaemonProcess(Path("/tmp/forkd-x/state"))
    d.start("--kill-on-exit")          # returns once /healthz answers
    with Controller(d.url, token_file=d.token_path) as ctl:
        ...
    d.stop()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from forkd import paths
from forkd.client.connection import Address, send
from forkd.client.errors import ControllerError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _port_of(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:  # not a port: the daemon will refuse the address itself
        return None


class DaemonStartError(RuntimeError):
    """The daemon exited, or did not answer ``/healthz`` in time."""


class DaemonProcess:
    """A ``forkd serve`` subprocess: its address, state directory, token file and log.

    ``bind`` is ``HOST:PORT`` or ``unix:/path/to.sock`` (default: a free port
    on 127.0.0.1). ``token_file``: the daemon's token, else it uses (and on
    its first start writes) ``<state_dir>/token``. The daemon's output is
    appended to ``log`` (default: ``<state_dir>/daemon.log``), across restarts.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        bind: str | None = None,
        token_file: Path | None = None,
        log: Path | None = None,
        startup_secs: float = 60.0,
    ) -> None:
        self.state_dir = state_dir
        self.bind = bind or f"127.0.0.1:{free_port()}"
        self.url = self.bind if self.bind.startswith("unix:") else f"http://{self.bind}"
        self.port: int | None = _port_of(self.url)
        self.token_file = token_file
        self.log = log or state_dir / "daemon.log"
        self.startup_secs = startup_secs
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self, *extra: str) -> list[str]:
        """The command line of ``forkd serve`` for this daemon, then ``extra``."""
        argv = [
            sys.executable,
            "-m",
            "forkd.cli",
            "serve",
            "--bind",
            self.bind,
            "--state-dir",
            str(self.state_dir),
        ]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return [*argv, *extra]

    @property
    def token_path(self) -> Path:
        """The file holding this daemon's token: ``token_file``, else ``<state_dir>/token``."""
        return self.token_file if self.token_file is not None else paths.token_file(self.state_dir)

    @property
    def token(self) -> str | None:
        """This daemon's token; None before its first start, or when it runs without auth."""
        try:
            return self.token_path.read_text().strip() or None
        except OSError:
            return None

    def env(self) -> dict[str, str]:
        """This process's environment pointing forkd clients (CLI, SDK) at this daemon.

        ``FORKD_TOKEN_FILE`` names :attr:`token_path` once that exists, and a
        ``FORKD_TOKEN`` of this process is dropped: it belongs to another daemon.
        """
        env = {k: v for k, v in os.environ.items() if k not in ("FORKD_TOKEN", "FORKD_TOKEN_FILE")}
        env["FORKD_URL"] = self.url
        if self.token_file is not None or self.token_path.exists():
            env["FORKD_TOKEN_FILE"] = str(self.token_path)
        return env

    def _serve_env(self) -> dict[str, str]:
        # ``forkd serve`` reads FORKD_TOKEN_FILE as --token-file: one inherited from
        # this process would make the daemon use another daemon's token.
        return {k: v for k, v in os.environ.items() if k != "FORKD_TOKEN_FILE"}

    def start(self, *extra: str) -> None:
        """Start the daemon with ``extra`` arguments; return once it answers ``/healthz``.

        Raises :class:`DaemonStartError` with the end of the log if it exits
        first, or if it does not answer within ``startup_secs``.
        """
        self.log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with open(log_fd, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(*extra), stdout=log, stderr=log, env=self._serve_env()
            )
        self.wait_healthy()

    def wait_healthy(self) -> None:
        """Poll ``/healthz`` until it answers 200 (see :meth:`start`)."""
        assert self.proc is not None, "start() the daemon first"
        deadline = time.monotonic() + self.startup_secs
        # /healthz needs no token: send none, not even one from the default state dir.
        address = Address.parse(self.url)
        with address.client(token=None, timeout=1.0, local_token=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise DaemonStartError(f"daemon exited: {self.log_tail()}")
                try:
                    send(client, self.url, "GET", "/healthz")
                    return
                except ControllerError:  # not listening yet, or not healthy yet
                    pass
                time.sleep(0.05)
        raise DaemonStartError(f"daemon did not start within {self.startup_secs:g} s")

    def log_tail(self, chars: int = 2000) -> str:
        """The last ``chars`` characters of the daemon's log."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` if the daemon still runs, and wait up to 60 s for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)
        self.proc = None


class GatewayProcess(DaemonProcess):
    """A ``forkd gateway`` subprocess over ``nodes`` (their URLs), clients' token in
    ``token_file``; ``extra`` arguments of :meth:`start` follow (``--registry R``, ...)."""

    def __init__(
        self,
        root: Path,
        nodes: list[str],
        node_token_file: Path,
        token_file: Path,
        *,
        bind: str | None = None,
        startup_secs: float = 60.0,
    ) -> None:
        super().__init__(
            root,
            bind=bind,
            token_file=token_file,
            log=root / "gateway.log",
            startup_secs=startup_secs,
        )
        self.nodes = nodes
        self.node_token_file = node_token_file

    def argv(self, *extra: str) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "forkd.cli",
            "gateway",
            "--bind",
            self.bind,
            "--node-token-file",
            str(self.node_token_file),
        ]
        for url in self.nodes:
            argv += ["--node", url]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return [*argv, *extra]
