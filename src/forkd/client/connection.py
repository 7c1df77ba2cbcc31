"""How the SDK reaches the daemon: its address, its token, and what a failed request means.

The daemon's address is ``http://host:port`` or ``unix:/path/to.sock``
(``$FORKD_URL``, default ``http://127.0.0.1:8889``). Its token is the first of:

1. the ``token=`` argument;
2. the contents of the ``token_file=`` argument;
3. ``$FORKD_TOKEN``;
4. the contents of the file named by ``$FORKD_TOKEN_FILE``;
5. ``<state-dir>/token``, the token a daemon on this host writes on its first
   start (the state directory is ``$FORKD_STATE_DIR``, else forkd's default),
   but only for a loopback or unix-socket address, and skipped without a word
   when it cannot be read. A token read from disk is never sent off this host.

A file named in 2 or 4 that cannot be read is an error. Every failure on the
way (no answer, a non-2xx answer, a body that is not JSON) becomes a
:class:`~forkd.client.errors.ControllerError`.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


def _import_httpx_light() -> None:
    """Import httpx without its own command line (``httpx._main``).

    httpx's ``__init__`` imports ``httpx._main`` whenever click, rich and
    pygments are installed (as they are next to the daemon), which triples the
    import time of this SDK. Marking that one submodule as absent during the
    import makes httpx fall back to its stub ``main``; the mark is removed
    afterwards, so an explicit ``import httpx._main`` later still works.
    """
    if "httpx" in sys.modules or "httpx._main" in sys.modules:
        return
    sys.modules["httpx._main"] = None  # type: ignore[assignment]  # None marks a module absent to import; typeshed allows modules only
    try:
        import httpx  # noqa: F401
    finally:
        if sys.modules.get("httpx._main", 0) is None:
            del sys.modules["httpx._main"]


_import_httpx_light()

import httpx  # noqa: E402

from forkd import __version__, paths  # noqa: E402
from forkd.client.errors import ControllerError  # noqa: E402

DEFAULT_URL = "http://127.0.0.1:8889"
_UDS_BASE = "http://forkd"

JSONDict = dict[str, Any]


def _read_token_file(path: str | os.PathLike[str]) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ControllerError(0, f"cannot read token file {os.fspath(path)}: {exc}") from exc
    return token or None


def _resolve_token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    if token:
        return token
    if token_file:
        return _read_token_file(token_file)
    env = os.environ.get("FORKD_TOKEN", "").strip()
    if env:
        return env
    env_file = os.environ.get("FORKD_TOKEN_FILE")
    if env_file:
        return _read_token_file(env_file)
    return None


def _read_local_token() -> str | None:
    """The token in ``<state-dir>/token`` (source 5), or None when it cannot be read."""
    try:
        return _read_token_file(paths.token_file())
    except (ControllerError, ValueError, RuntimeError, KeyError):  # ValueError: not text;
        return None  # RuntimeError, KeyError: no home directory to find the state dir in


def is_loopback_host(host: str) -> bool:
    """``localhost``, a loopback address (IPv6 in brackets or not), or no host at all."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Address:
    """Where the daemon listens: as given (``url``) and as httpx reaches it."""

    url: str
    base_url: str
    socket_path: str | None
    # Proxy settings from the environment apply only to a daemon off this host.
    trust_env: bool

    @classmethod
    def parse(cls, url: str | None) -> Address:
        """``url``, else ``$FORKD_URL``, else :data:`DEFAULT_URL`; ``host:port`` means http."""
        url = (url or os.environ.get("FORKD_URL") or DEFAULT_URL).strip()
        if url.startswith("unix:"):
            path = url[len("unix:") :]
            if path.startswith("//"):  # unix:///run/forkd.sock
                path = path[2:]
            if not path:
                raise ValueError(f"no socket path in {url!r}")
            return cls(url, _UDS_BASE, path, trust_env=False)
        base = (url if "://" in url else "http://" + url).rstrip("/")
        return cls(url, base, None, trust_env=not is_loopback_host(urlsplit(base).hostname or ""))

    @property
    def is_local(self) -> bool:
        """A unix socket or a loopback address: a daemon on this host."""
        # httpx's own parse: the host it will connect to, not another parser's idea of it.
        return self.socket_path is not None or is_loopback_host(httpx.URL(self.base_url).host)

    def bearer(self, token: str | None, local_token: bool = True) -> str | None:
        """The token to send: ``token``; without it, for a local address (:attr:`is_local`),
        the one a daemon wrote to ``<state-dir>/token`` if that can be read (unless
        ``local_token`` is false)."""
        if not token and local_token and self.is_local:
            return _read_local_token()
        return token

    def _client_args(self, token: str | None, local_token: bool) -> dict[str, Any]:
        """What both HTTP clients are made with: the bearer token (:meth:`bearer`), the
        User-Agent, the base URL and whether proxies from the environment apply."""
        token = self.bearer(token, local_token)
        headers = {"User-Agent": f"forkd-client/{__version__}", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return {"base_url": self.base_url, "headers": headers, "trust_env": self.trust_env}

    def client(
        self,
        token: str | None,
        timeout: float,
        transport: httpx.BaseTransport | None = None,
        *,
        local_token: bool = True,
    ) -> httpx.Client:
        """A synchronous HTTP client of the daemon sending ``token`` as its bearer token."""
        if transport is None and self.socket_path is not None:
            transport = httpx.HTTPTransport(uds=self.socket_path)
        args = self._client_args(token, local_token)
        return httpx.Client(timeout=timeout, transport=transport, **args)

    def async_client(
        self,
        token: str | None,
        timeout: float,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        local_token: bool = True,
    ) -> httpx.AsyncClient:
        """The same, for asyncio (:class:`forkd.client.AsyncController`)."""
        if transport is None and self.socket_path is not None:
            transport = httpx.AsyncHTTPTransport(uds=self.socket_path)
        args = self._client_args(token, local_token)
        return httpx.AsyncClient(timeout=timeout, transport=transport, **args)


def _failure(exc: httpx.TransportError, url: str, method: str, path: str) -> ControllerError:
    """What a request that got no answer means, for the messages of both clients."""
    if isinstance(exc, httpx.ConnectError):
        return ControllerError(
            0,
            f"the forkd daemon is not reachable at {url} ({exc}); start it with `forkd serve`",
        )
    if isinstance(exc, httpx.TimeoutException):
        return ControllerError(
            0, f"no answer from the forkd daemon at {url} in time ({method} {path})"
        )
    return ControllerError(0, f"talking to the forkd daemon at {url} failed: {exc!r}")


def _checked(resp: httpx.Response) -> httpx.Response:
    if not resp.is_success:
        raise ControllerError.from_response(resp)
    return resp


def send(client: httpx.Client, url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    """``client.request(method, path, **kw)``; a ControllerError unless the answer is 2xx.

    ``url`` is the daemon's address as the caller knows it, for the messages.
    """
    try:
        resp = client.request(method, path, **kw)
    except httpx.TransportError as exc:
        raise _failure(exc, url, method, path) from exc
    return _checked(resp)


async def asend(
    client: httpx.AsyncClient, url: str, method: str, path: str, **kw: Any
) -> httpx.Response:
    """:func:`send` for an async client."""
    try:
        resp = await client.request(method, path, **kw)
    except httpx.TransportError as exc:
        raise _failure(exc, url, method, path) from exc
    return _checked(resp)


def json_of(resp: httpx.Response, method: str, path: str) -> Any:
    """The JSON body of a 2xx answer to ``method path``; None when it has none."""
    if resp.status_code == 204 or not resp.content:
        return None
    try:
        return resp.json()
    except ValueError as exc:
        raise ControllerError(
            resp.status_code,
            f"the daemon answered {method} {path} with something that is not JSON",
            resp.text,
        ) from exc
