"""What envd's Connect services on the E2B port share: the sandbox a call is for (its
headers, checked by :func:`.target.sandbox_for`), the user it names, and the ASGI app
connectrpc serves a service's methods from."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from connectrpc.method import IdempotencyLevel, MethodInfo
from connectrpc.request import RequestContext
from connectrpc.server import ConnectASGIApplication
from protobuf import Message

from forkd.controller.e2b.target import basic_user, port_of, sandbox_for
from forkd.controller.services import Services

Ctx = RequestContext[Any, Any]
S = TypeVar("S")


class SandboxRPC:
    """A service over the daemon's ``services`` (made at its start, so asked for each call)."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self._services = services

    def sandbox(self, ctx: Ctx) -> tuple[Services, str]:
        """The daemon's services and the id of the sandbox ``ctx``'s headers name."""
        headers = ctx.request_headers
        svc = self._services()
        row = sandbox_for(
            svc,
            headers.get("e2b-sandbox-id"),
            port_of(headers.get("e2b-sandbox-port")),
            headers.get("x-access-token"),
        )
        return svc, row.id

    @staticmethod
    def user(ctx: Ctx) -> str | None:
        """The user the call is for (E2B's Basic authorization), None: the image's."""
        return basic_user(ctx.request_headers.get("authorization"))


def method(
    service: str, name: str, request: type[Message], response: type[Message]
) -> MethodInfo[Any, Any]:
    return MethodInfo(
        name=name,
        service_name=service,
        input=request,
        output=response,
        idempotency_level=IdempotencyLevel.UNKNOWN,
    )


class ServiceApp(ConnectASGIApplication[S], Generic[S]):
    """``service``'s methods, as ``endpoints(service)`` maps them, served at
    ``/<package.Service>/<Method>`` (``path``)."""

    def __init__(
        self,
        service: S,
        path: str,
        endpoints: Callable[[S], Mapping[str, Any]],
        read_max_bytes: int,
    ) -> None:
        super().__init__(service=service, endpoints=endpoints, read_max_bytes=read_max_bytes)
        self._path = path

    @property
    def path(self) -> str:
        return self._path
