"""A real OCI registry for tests: Debian's ``docker-registry`` on 127.0.0.1, its storage
in a temporary directory, optionally asking for a user and password (htpasswd).

A daemon reaches a registry on loopback only when it lists it: start one with
``--insecure-registry`` :attr:`RegistryServer.address` (or put the address in
``Settings.insecure_registries``), and give a :class:`~forkd.oci.registry.Registry`
of a test :meth:`RegistryServer.policy`."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from forkd.oci.policy import RegistryPolicy

BINARY = "docker-registry"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_address() -> str:
    """A free ``127.0.0.1:PORT``: where a registry started later listens (a daemon
    started first can list it with ``--insecure-registry``)."""
    return f"127.0.0.1:{_free_port()}"


class RegistryServer:
    def __init__(
        self, user: str | None = None, password: str | None = None, address: str | None = None
    ) -> None:
        path = shutil.which(BINARY)
        if path is None:
            pytest.skip(f"{BINARY} is not installed (apt-get install docker-registry; dev.sh does)")
        self.root = Path(tempfile.mkdtemp(prefix="forkd-registry-", dir="/tmp"))
        self.address = address or free_address()
        self.port = int(self.address.rsplit(":", 1)[1])
        config = [
            "version: 0.1",
            "log:",
            "  level: warn",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {self.root / 'data'}",
            "  delete:",
            "    enabled: true",
            "http:",
            f"  addr: {self.address}",
        ]
        if user and password:
            import bcrypt

            hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
            (self.root / "htpasswd").write_text(f"{user}:{hashed}\n")
            config += [
                "auth:",
                "  htpasswd:",
                "    realm: forkd-test",
                f"    path: {self.root / 'htpasswd'}",
            ]
        (self.root / "config.yml").write_text("\n".join(config) + "\n")
        self.log = (self.root / "registry.log").open("wb")
        self.proc = subprocess.Popen(
            [path, "serve", str(self.root / "config.yml")], stdout=self.log, stderr=self.log
        )
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{self.address}/v2/", timeout=1).status_code in (200, 401):
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{BINARY} did not start: {(self.root / 'registry.log').read_text()}")

    def ref(self, repository: str, tag: str | None = None) -> str:
        return f"{self.address}/{repository}" + (f":{tag}" if tag else "")

    def policy(self) -> RegistryPolicy:
        """A registry policy that lists this registry, as ``--insecure-registry`` does."""
        return RegistryPolicy.of([self.address])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)
