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
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forkd.controller.http_errors import error_response, refuse_websocket
from forkd.controller.services.preview_domain import LABEL, PreviewDomain
from forkd.controller.services.preview_tokens import parse
from forkd.errors import Forbidden

_PREVIEW_PATH = re.compile(r"^/v1/preview/([^/]+)(/.*)?$", re.DOTALL)
OWN_ORIGIN = "forkd_preview_own_origin"  # set in the scope's state on a preview host
AT_ROOT = "forkd_preview_at_root"  # and when the request came for the host's root paths
COOKIE = "forkd-preview"  # the host's preview token, for paths outside its prefix


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
            _drop_our_cookie(scope)
            await self.app(scope, receive, _with_cookie(scope, send, asked))
        elif on_preview_host and asked is None and (token := _cookie_token(scope, on_preview_host)):
            # A path outside the prefix (a page's absolute link): the token is the host's
            # cookie, set by its preview URL; served as that URL's path.
            _served_at_root(scope, token)
            await self.app(scope, receive, send)
        elif on_preview_host is None and asked is not None and scope["type"] == "http":
            await self._redirect(scope, receive, send, host, asked)
        else:
            why = (
                f"{scope['path']} is not served on this preview host"
                if on_preview_host is not None
                else "preview URLs of this daemon are served on their own hosts"
            )
            if scope["type"] == "websocket":
                await refuse_websocket(scope, receive, send, 404, why)
            else:
                await error_response(404, why)(scope, receive, send)

    async def _redirect(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        host: str,
        asked: tuple[str, str, int, str],
    ) -> None:
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


def _with_cookie(scope: Scope, send: Send, asked: tuple[str, str, int, str]) -> Send:
    """``send``, its answer setting the host's preview cookie to the token (HttpOnly, for
    as long as the token lasts): the page's paths outside the prefix then work too."""
    if scope["type"] != "http":
        return send
    token = asked[3]
    try:
        lasts = parse(token).expires_at_unix - int(time.time())
    except Forbidden:
        return send
    secure = "; Secure" if scope.get("scheme") == "https" else ""
    cookie = f"{COOKIE}={token}; Path=/; Max-Age={max(lasts, 0)}; HttpOnly; SameSite=Lax{secure}"

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] < 400:
            headers = [*message.get("headers", []), (b"set-cookie", cookie.encode("latin-1"))]
            message = {**message, "headers": headers}
        await send(message)

    return sending


def _cookie_pairs(scope: Scope) -> list[tuple[str, str]]:
    pairs = []
    for key, value in scope["headers"]:
        if key == b"cookie":
            for item in value.decode("latin-1").split(";"):
                name, _, val = item.strip().partition("=")
                pairs.append((name, val))
    return pairs


def _cookie_token(scope: Scope, label: str) -> str | None:
    """The host's preview token from its cookie, when it names this host's (``label``)
    preview (its MAC and expiry are the route's to check)."""
    for name, value in _cookie_pairs(scope):
        asked = _asked_preview(f"/v1/preview/{value}/") if name == COOKIE else None
        if asked is not None and asked[0] == label:
            return value
    return None


def _drop_our_cookie(scope: Scope) -> None:
    """The request's ``Cookie`` without the preview cookie: the guest never sees it."""
    kept = "; ".join(f"{n}={v}" for n, v in _cookie_pairs(scope) if n != COOKIE)
    headers = [(k, v) for k, v in scope["headers"] if k != b"cookie"]
    scope["headers"] = headers + ([(b"cookie", kept.encode("latin-1"))] if kept else [])


def _served_at_root(scope: Scope, token: str) -> None:
    """``scope`` as if it had come for ``token``'s preview URL with its path."""
    state = scope.setdefault("state", {})
    state[OWN_ORIGIN] = state[AT_ROOT] = True
    _drop_our_cookie(scope)
    prefix = f"/v1/preview/{token}"
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    scope["path"] = prefix + scope["path"]
    scope["raw_path"] = prefix.encode() + raw


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
