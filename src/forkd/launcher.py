"""Starting a ``forkd serve`` process and waiting until it answers ``/healthz``.

Like the SDK it imports only the standard library and httpx. The demo starts
its daemon here when none answers, and so do the integration tests.

Example::

    d = DaemonProcess(Path("/tmp/forkd-x/state"), token_file=Path("/tmp/forkd-x/token"))
    d.start("--kill-on-exit")          # returns once /healthz answers
    with Controller(d.url, token_file=d.token_file) as ctl:
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

from forkd.client.connection import Address, send
from forkd.client.errors import ControllerError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    on 127.0.0.1). The daemon's output is appended to ``log`` (default:
    ``<state_dir>/daemon.log``), across restarts.
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
        argv = [sys.executable, "-m", "forkd.cli", "serve", "--bind", self.bind,
                "--state-dir", str(self.state_dir)]  # fmt: skip
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return [*argv, *extra]

    def env(self) -> dict[str, str]:
        """This process's environment pointing forkd clients (CLI, SDK) at this daemon."""
        env = {**os.environ, "FORKD_URL": self.url}
        if self.token_file is not None:
            env["FORKD_TOKEN_FILE"] = str(self.token_file)
        return env

    def start(self, *extra: str) -> None:
        """Start the daemon with ``extra`` arguments; return once it answers ``/healthz``.

        Raises :class:`DaemonStartError` with the end of the log if it exits
        first, or if it does not answer within ``startup_secs``.
        """
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv(*extra), stdout=log, stderr=log, env=self.env())
        self.wait_healthy()

    def wait_healthy(self) -> None:
        """Poll ``/healthz`` until it answers 200 (see :meth:`start`)."""
        assert self.proc is not None, "start() the daemon first"
        deadline = time.monotonic() + self.startup_secs
        with Address.parse(self.url).client(token=None, timeout=1.0) as client:
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
