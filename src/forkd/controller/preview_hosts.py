"""Preview URLs on origins of their own (``forkd serve --preview-domain``).

Without it every preview URL is on the daemon's origin, which the console and every
other sandbox's pages share. With ``--preview-domain preview.example.com`` (a
wildcard DNS name pointing at the daemon) a preview of port P of sandbox S is
``<scheme>://P-S.preview.example.com[:port]/v1/preview/<token>/``: a browser origin
per sandbox and port. :class:`PreviewHosts`, before the bearer check, keeps the two
apart: a preview host serves its own preview and nothing else (no API, no console,
no other sandbox's preview), and a preview asked for on the daemon's own host is
redirected to its host.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from forkd.controller.http_errors import error_response, refuse_websocket
from forkd.controller.services.preview_domain import LABEL, PreviewDomain
from forkd.controller.services.preview_tokens import parse
from forkd.errors import Forbidden

_PREVIEW_PATH = re.compile(r"^/v1/preview/([^/]+)(/.*)?$", re.DOTALL)
OWN_ORIGIN = "forkd_preview_own_origin"  # set in the scope's state on a preview host


class PreviewHosts:
    """ASGI middleware: a preview host serves only its own preview URL; a preview URL
    asked for on the daemon's own host is redirected (307) to its host."""

    def __init__(self, app: ASGIApp, domain: PreviewDomain | None) -> None:
        self.app = app
        self.domain = domain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.domain is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
        on_preview_host = self.domain.label_of(host)
        asked = _asked_preview(scope["path"])
        if on_preview_host is None and not _PREVIEW_PATH.match(scope["path"]):
            await self.app(scope, receive, send)  # the daemon's own host, not a preview
        elif on_preview_host and asked is not None and on_preview_host == asked[0]:
            scope.setdefault("state", {})[OWN_ORIGIN] = True
            await self.app(scope, receive, send)
        elif on_preview_host is None and asked is not None and scope["type"] == "http":
            await self._redirect(scope, receive, send, host, asked)
        else:
            why = (f"{scope['path']} is not served on this preview host"
                   if on_preview_host is not None
                   else "preview URLs of this daemon are served on their own hosts")  # fmt: skip
            if scope["type"] == "websocket":
                await refuse_websocket(scope, receive, send, 404, why)
            else:
                await error_response(404, why)(scope, receive, send)

    async def _redirect(self, scope: Scope, receive: Receive, send: Send, host: str,
                        asked: tuple[str, str, int, str]) -> None:  # fmt: skip
        assert self.domain is not None
        _, sandbox_id, port, token = asked
        scheme = str(scope.get("scheme", "http"))
        url = self.domain.url(sandbox_id, port, token, f"{scheme}://{host}/")
        raw: bytes = scope.get("raw_path") or scope["path"].encode()
        url += raw.split(b"/", 4)[4].decode("latin-1") if raw.count(b"/") >= 4 else ""
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        answer = error_response(307, f"this preview is served on its own host: {url}")
        answer.headers["Location"] = url
        await answer(scope, receive, send)


def _asked_preview(path: str) -> tuple[str, str, int, str] | None:
    """(label, sandbox id, port, token) of the preview a path asks for, from its token
    (its MAC is the route's to check), or None when it asks for none."""
    match = _PREVIEW_PATH.match(path)
    if match is None:
        return None
    try:
        claim = parse(match.group(1))
    except Forbidden:
        return None
    label = PreviewDomain.label(claim.sandbox_id, claim.port)
    return (label, claim.sandbox_id, claim.port, match.group(1)) if LABEL.match(label) else None
