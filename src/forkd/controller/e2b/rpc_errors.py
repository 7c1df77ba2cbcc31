"""The daemon's errors as Connect errors, for the envd services E2B's SDKs call: each
becomes the code those SDKs turn into their own exceptions (``not_found`` into
NotFoundException or FileNotFoundException, ``unavailable`` "was not found" into
"the sandbox is not running", ``deadline_exceeded`` into TimeoutException, ...)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from forkd.controller.http_errors import hide_host_paths, status_of
from forkd.errors import ForkdError

# By the HTTP status the daemon's own API answers the same error with.
CODE_OF_STATUS = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.FAILED_PRECONDITION,
    429: Code.RESOURCE_EXHAUSTED,
    502: Code.UNAVAILABLE,
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
    507: Code.RESOURCE_EXHAUSTED,
}

log = logging.getLogger("forkd.e2b")
P = ParamSpec("P")
T = TypeVar("T")


def connect_error(exc: ForkdError) -> ConnectError:
    code = CODE_OF_STATUS.get(status_of(exc), Code.INTERNAL)
    return ConnectError(code, hide_host_paths(str(exc)))


@contextmanager
def as_connect_errors() -> Iterator[None]:
    """Within: a daemon error leaves as its Connect error; anything else is the daemon's
    bug, logged with its traceback and answered as ``internal`` without its words (the
    Connect runtime would send ``str(exc)``, host paths and all)."""
    try:
        yield
    except ConnectError:
        raise
    except ForkdError as exc:
        raise connect_error(exc) from None
    except Exception:
        error_id = secrets.token_hex(6)
        log.exception("E2B port: a Connect call failed (error id %s)", error_id)
        raise ConnectError(Code.INTERNAL, f"internal error (id {error_id})") from None


def unary(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """A unary handler whose daemon errors answer as Connect errors."""

    async def handler(*args: P.args, **kwargs: P.kwargs) -> T:
        with as_connect_errors():
            return await fn(*args, **kwargs)

    return handler


def streamed(fn: Callable[P, AsyncIterator[T]]) -> Callable[P, AsyncIterator[T]]:
    """A server-streaming handler whose daemon errors end its stream as Connect errors."""

    async def handler(*args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        with as_connect_errors():
            async for item in fn(*args, **kwargs):
                yield item

    return handler
