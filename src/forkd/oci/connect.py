"""Connections to one registry, each checked against the operator's policy
(:class:`~forkd.oci.policy.RegistryPolicy`) before a byte is sent.

httpx would connect to whatever a name resolves to. Here every request's URL is
checked (plain HTTP only to a listed registry: a redirect or a token realm
may not lead elsewhere), the name is resolved once, every address it gives is
checked (one on this host only for a listed registry), and the connection is
made to a checked address: a name that resolves to the host, or a second
lookup that answers otherwise (DNS rebinding), cannot reach the host's own
services. TLS still checks the certificate against the name. The environment's
proxies are not used: behind one, no address could be checked.

Every connection's reads and writes are also held to the deadline of the transfer
under way (:func:`transfer_deadline`): each waits at most until then, so a
registry that sends a byte now and then, slower than any read timeout but never
quiet long enough to trip one, is cut off at the deadline all the same, in its
headers as in its body.
"""

from __future__ import annotations

import contextlib
import contextvars
import socket
import ssl
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

from forkd import import_deadline
from forkd.errors import Invalid
from forkd.oci.policy import RegistryPolicy, is_this_host

KEEPALIVE_SECS = 5.0  # httpx's own default
# When the transfer this thread is making must be over (time.monotonic()); None: no bound
# beyond each read's own timeout.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "forkd_registry_deadline", default=None
)


@contextlib.contextmanager
def transfer_deadline(at: float) -> Iterator[None]:
    """Within the block, every read and write on a registry connection of this thread
    waits at most until ``at`` (``time.monotonic()``); past it they time out."""
    token = _DEADLINE.set(at)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _bounded(timeout: float | None, timed_out: type[Exception]) -> float | None:
    ats = [a for a in (_DEADLINE.get(), import_deadline.deadline()) if a is not None]
    if not ats:
        return timeout
    at = min(ats)
    left = at - time.monotonic()
    if left <= 0:
        raise timed_out("the transfer ran past its deadline")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write ends by the transfer's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, bounded))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class CheckedTransport(httpx.HTTPTransport):
    """httpx's transport, its pool (unused yet) replaced by one whose connections
    :class:`_Backend` makes."""

    def __init__(self, policy: RegistryPolicy, registry: str) -> None:
        super().__init__()
        self._policy, self._registry = policy, registry
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),  # SSL_CERT_FILE and SSL_CERT_DIR count
            keepalive_expiry=KEEPALIVE_SECS,
            network_backend=_Backend(policy, registry),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "https" and not self._policy.lists(url.host, url.port):
            raise Invalid(
                f"registry {self._registry}: a request over plain HTTP to a host not listed "
                "with the daemon's --insecure-registry was refused"
            )
        return super().handle_request(request)


class _Backend(httpcore.NetworkBackend):
    """Connects to a checked address of the name: one on this host only when listed."""

    def __init__(self, policy: RegistryPolicy, registry: str) -> None:
        self._policy, self._registry = policy, registry
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _bounded(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._connect(host, port, timeout, local_address, socket_options))

    def _connect(
        self,
        host: str,
        port: int,
        timeout: float | None,
        local_address: str | None,
        socket_options: Iterable[Any] | None,
    ) -> httpcore.NetworkStream:
        if self._policy.lists(host, port):
            return self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        if is_this_host(host):  # an address: no lookup
            raise self._refused()
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
        if any(is_this_host(address) for address in addresses):
            raise self._refused()
        failure: Exception = httpcore.ConnectError(f"{host} has no address")
        for address in addresses:
            try:
                return self._inner.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        raise failure

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise self._refused()  # never asked for: no registry URL names a socket

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)

    def _refused(self) -> Invalid:
        return Invalid(
            f"registry {self._registry}: a connection to this host's own address (its name, "
            "a redirect or a token realm led there) was refused; the daemon reaches such a "
            "registry only when its operator lists it with --insecure-registry HOST[:PORT]"
        )
