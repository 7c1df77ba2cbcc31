"""What every JSON route of the SDK is built on: :class:`Call`, the :func:`route` decorator
that hands a call to the client it is read from, and :class:`RouteBase`, the
plumbing each resource's routes use."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload
from urllib.parse import quote

import httpx

from forkd.client.connection import Address, _resolve_token, json_of

# An eval's answer comes within its timeout plus the agent's grace to stop it
# and the daemon's margin (15 s): the HTTP wait allows a little more.
EVAL_HTTP_MARGIN_SECS = 30.0

KEEP: Any = object()  # an optional setting left as the daemon has it

T = TypeVar("T")
U = TypeVar("U")
P = ParamSpec("P")


def response_of(resp: httpx.Response) -> httpx.Response:
    return resp


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request to the daemon and what to make of its answer: ``decode``."""

    method: str
    path: str
    decode: Callable[[httpx.Response], T]
    json_body: Any = None
    params: dict[str, Any] | None = None
    content: bytes | None = None
    headers: dict[str, str] | None = None
    timeout: float | None = None

    def then(self, then: Callable[[T], U]) -> Call[U]:
        """The same request, its decoded answer passed through ``then``."""
        decode = self.decode
        return Call(
            self.method,
            self.path,
            lambda resp: then(decode(resp)),
            self.json_body,
            self.params,
            self.content,
            self.headers,
            self.timeout,
        )


class SyncRunner:
    """A client that sends a :class:`Call` and returns its answer (Controller)."""

    def _run(self, call: Call[T]) -> T:
        raise NotImplementedError


class AsyncRunner:
    """A client whose :class:`Call` s are awaited (AsyncController)."""

    def _run(self, call: Call[T]) -> Awaitable[T]:
        raise NotImplementedError


class _Route(Generic[P, T]):
    """How the type checker sees a route method: read from the sync client it returns
    the answer, from the async one an awaitable of it."""

    def __init__(self, build: Callable[Concatenate[Any, P], Call[T]]) -> None: ...
    @overload
    def __get__(
        self, client: None, owner: type | None = None
    ) -> Callable[Concatenate[Any, P], Any]: ...
    @overload
    def __get__(self, client: SyncRunner, owner: type | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, client: AsyncRunner, owner: type | None = None
    ) -> Callable[P, Awaitable[T]]: ...
    def __get__(self, client: object, owner: type | None = None) -> Any: ...


def _route(build: Callable[..., Call[Any]]) -> Callable[..., Any]:
    """A route method: ``build`` makes its :class:`Call` and the client it is called on
    runs it (its ``_run``: the answer, or an awaitable of it). At run time it is a
    plain function, so ``Controller.health(ctl)``, monkeypatching, ``help()`` and
    ``mock.create_autospec`` work as for any method; ``help()`` shows the answer's type."""

    @functools.wraps(build)
    def method(self: SyncRunner | AsyncRunner, *args: Any, **kwargs: Any) -> Any:
        return self._run(build(self, *args, **kwargs))

    built = inspect.signature(build)
    answer = str(built.return_annotation).removeprefix("Call[").removesuffix("]")
    method.__signature__ = built.replace(return_annotation=answer)  # type: ignore[attr-defined]  # read by inspect; typeshed's functions declare none
    return method


if TYPE_CHECKING:
    route = _Route
else:
    route = _route


def quote_segment(segment: str) -> str:
    """Percent-encode one URL path segment (``/`` included)."""
    return quote(str(segment), safe="")


def drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def no_answer(_: object) -> None:
    return None


def content_of(resp: httpx.Response) -> bytes:
    return resp.content


def text_of(resp: httpx.Response) -> str:
    return resp.text


def written_of(answer: Any) -> int:
    return int(answer["written"])


def entries_of(body: Any) -> Any:
    """A listing's entries (older daemons answered the bare list)."""
    if isinstance(body, dict) and isinstance(body.get("entries"), list):
        return body["entries"]
    return body


class RouteBase:
    """What the JSON routes share; the client supplies the four attributes below."""

    url: str
    timeout: float
    base_url: str
    socket_path: str | None

    def _address(
        self,
        base_url: str | None,
        timeout: float,
        token: str | None,
        token_file: str | os.PathLike[str] | None,
    ) -> tuple[Address, str | None]:
        """Where the daemon is and the token to send it (both clients' constructors)."""
        address = Address.parse(base_url)
        self.url, self.base_url = address.url, address.base_url
        self.socket_path = address.socket_path
        self.timeout = float(timeout)
        return address, _resolve_token(token, token_file)

    @staticmethod
    def _request(method: str, path: str, **kw: Any) -> Call[httpx.Response]:
        """The call whose answer is the response itself."""
        return Call(method, path, response_of, **kw)

    @staticmethod
    def _json(method: str, path: str, **kw: Any) -> Call[Any]:
        """The call whose answer is the response's JSON (an error status raises)."""
        return Call(method, path, lambda resp: json_of(resp, method, path), **kw)

    @staticmethod
    def _sb(sandbox_id: str) -> str:
        return f"/v1/sandboxes/{quote_segment(sandbox_id)}"


def label_filters(metadata: dict[str, str] | None) -> dict[str, str]:
    """``metadata`` as the list routes' query parameters: ``metadata.KEY=VALUE``."""
    return {f"metadata.{key}": value for key, value in (metadata or {}).items()}
