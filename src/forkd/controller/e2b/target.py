"""Which sandbox a request to the E2B port's sandbox side is for, and whether it may
ask: the ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers name it, the
``X-Access-Token`` its creation answered proves the caller holds it. The ``/files``
routes (:mod:`.envd`) and the Connect services (:mod:`.process_rpc`,
:mod:`.filesystem_rpc`) all ask here.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import Header, Request

from forkd.controller.e2b.rest import services
from forkd.controller.services import Services
from forkd.controller.store_rows import SandboxRow
from forkd.errors import Invalid, Unauthorized, UpstreamError
from forkd.states import SandboxState

ENVD_PORT = 49983  # E2B's in-guest daemon
INTERPRETER_PORT = 49999  # E2B's code interpreter


def sandbox_for(
    svc: Services,
    sandbox_id: str | None,
    port: int | None,
    token: str | None,
    served: int = ENVD_PORT,
) -> SandboxRow:
    """The record of the sandbox ``sandbox_id`` once ``token`` is checked (401 without
    one, before anything is looked up; another sandbox's is "not found", as an unknown
    id); ``port`` must be the ``served`` one (envd's, or the code interpreter's)."""
    if not sandbox_id:
        raise Invalid("no E2b-Sandbox-Id header: which sandbox is this for?")
    if token is None:  # before anything is looked up: no answer says what exists
        raise Unauthorized("no X-Access-Token: the one the sandbox's creation answered")
    row = live_row(svc, sandbox_id)
    want = svc.ports.key.access_token(sandbox_id, row.created_at_unix)
    if not hmac.compare_digest(want.encode(), token.encode()):
        raise _gone(sandbox_id)  # another sandbox's token: as an unknown id
    if port is not None and port != served:
        raise UpstreamError(f"port {port} is not open on sandbox {sandbox_id!r} (not served yet)")
    return row


def live_row(svc: Services, sandbox_id: str) -> SandboxRow:
    """The sandbox's record, unless it is unknown or dead: E2B's words for that, which its
    SDKs read as "the sandbox is not running"."""
    row = svc.store.get_sandbox(sandbox_id)
    if row is None or row.state == SandboxState.DEAD:
        raise _gone(sandbox_id)
    return row


def _gone(sandbox_id: str) -> UpstreamError:
    return UpstreamError(f"sandbox {sandbox_id!r} was not found")


def sandbox_dependency(served: int) -> Callable[..., SandboxRow]:
    """A route's dependency: the record of the sandbox its request is for, served on
    ``served`` (envd's port, or the code interpreter's), its access token checked (as
    ``X-Access-Token``, or the traffic token E2B's SDKs send on calls without one)."""

    def target(
        request: Request,
        sandbox_id: Annotated[str | None, Header(alias="E2b-Sandbox-Id")] = None,
        port: Annotated[str | None, Header(alias="E2b-Sandbox-Port")] = None,
        token: Annotated[str | None, Header(alias="X-Access-Token")] = None,
        traffic: Annotated[str | None, Header(alias="E2B-Traffic-Access-Token")] = None,
    ) -> SandboxRow:
        return sandbox_for(
            services(request), sandbox_id, port_of(port, served), token or traffic, served
        )

    return target


def port_of(header: str | None, default: int = ENVD_PORT) -> int:
    """The ``E2b-Sandbox-Port`` header's port (``default`` when absent)."""
    if header is None:
        return default
    try:
        return int(header)
    except ValueError:
        raise Invalid(f"E2b-Sandbox-Port {header[:20]!r} is not a port") from None


def basic_user(authorization: str | None) -> str | None:
    """The user an ``Authorization: Basic base64(user:)`` header names (E2B's SDKs say
    whom a command or file operation is for this way); None without one."""
    if not authorization:
        return None
    scheme, _, encoded = authorization.partition(" ")
    if scheme.lower() != "basic":
        raise Invalid("Authorization here is Basic: the user a call is for")
    try:
        user = base64.b64decode(encoded.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise Invalid("Authorization: Basic with a malformed value") from None
    return user.partition(":")[0] or None
