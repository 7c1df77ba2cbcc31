"""Registry credentials, and the challenge-response every registry speaks.

Credentials come from a token given with the request, or else from docker's
``config.json`` (``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``):
``auths[host]`` with ``auth`` (base64 ``user:password``), ``username`` and
``password``, or ``identitytoken``. Credential helpers (``credsStore``) are
programs forkd does not run; a registry that needs one answers 401, and the
error says to give a token or a plain entry instead.

:class:`RegistryAuth` is an ``httpx.Auth``: a request answered 401 is retried
once with what the ``WWW-Authenticate`` challenge asks for, Basic or a Bearer
token fetched from the challenge's realm (with the credentials, if any).
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')
TOKEN_BYTES_LIMIT = 64 << 10


@dataclass(frozen=True)
class Credentials:
    username: str | None = None
    password: str | None = None
    identity_token: str | None = None  # an OAuth2 refresh token, from `docker login`
    bearer: str | None = None  # used as it is, no exchange


def docker_config_path() -> Path:
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def from_docker_config(registry: str, path: Path | None = None) -> Credentials | None:
    """The credentials docker's ``config.json`` holds for ``registry`` (host[:port])."""
    try:
        data = json.loads((path or docker_config_path()).read_text())
    except (OSError, ValueError):
        return None
    auths = data.get("auths") if isinstance(data, dict) else None
    if not isinstance(auths, dict):
        return None
    names = {registry, f"https://{registry}", f"http://{registry}"}
    if registry == "registry-1.docker.io":
        names |= {"docker.io", "index.docker.io", "https://index.docker.io/v1/"}
    for key, entry in auths.items():
        if key.rstrip("/") in names or key in names:
            return _entry(entry) if isinstance(entry, dict) else None
    return None


def _entry(entry: dict[str, Any]) -> Credentials | None:
    user, password = entry.get("username"), entry.get("password")
    if entry.get("auth"):
        try:
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
    token = entry.get("identitytoken") or None
    if not (user and password) and not token:
        return None
    return Credentials(user or None, password or None, token)


class RegistryAuth(httpx.Auth):
    """Answers a registry's 401 once per request; the header found is kept for the next."""

    def __init__(self, credentials: Credentials | None, plain_http_realm: bool = False) -> None:
        self.credentials = credentials
        # A realm over plain HTTP would carry the password in clear: only where the
        # registry itself may be spoken to that way (loopback, or insecure by choice).
        self.plain_http_realm = plain_http_realm
        self._header: str | None = None
        if credentials and credentials.bearer:
            self._header = f"Bearer {credentials.bearer}"

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if self._header:
            request.headers["Authorization"] = self._header
        response = yield request
        if response.status_code != 401 or (self.credentials and self.credentials.bearer):
            return
        scheme, params = parse_challenge(response.headers.get("WWW-Authenticate", ""))
        basic = self._basic()
        if scheme == "basic" and basic:
            self._header = basic
        elif scheme == "bearer" and self._realm_ok(params.get("realm", "")):
            token_response = yield self._token_request(params)
            token = _token_of(token_response)
            if token is None:
                return  # the 401 stands: the caller reports it
            self._header = f"Bearer {token}"
        else:
            return
        request.headers["Authorization"] = self._header
        yield request

    def _realm_ok(self, realm: str) -> bool:
        return realm.startswith("https://") or (
            self.plain_http_realm and realm.startswith("http://")
        )

    def _basic(self) -> str | None:
        c = self.credentials
        if not c or not c.username or not c.password:
            return None
        return "Basic " + base64.b64encode(f"{c.username}:{c.password}".encode()).decode()

    def _token_request(self, params: dict[str, str]) -> httpx.Request:
        query = {k: params[k] for k in ("service", "scope") if params.get(k)}
        c = self.credentials
        if c and c.identity_token:
            form = {
                **query,
                "grant_type": "refresh_token",
                "refresh_token": c.identity_token,
                "client_id": "forkd",
            }
            return httpx.Request("POST", params["realm"], data=form)
        basic = self._basic()
        headers = {"Authorization": basic} if basic else {}
        return httpx.Request("GET", params["realm"], params=query, headers=headers)


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="…",service="…"`` → ``("bearer", {"realm": …, "service": …})``."""
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in _CHALLENGE_PARAM.findall(rest)}


def _token_of(response: httpx.Response) -> str | None:
    """The token a realm answered, read raw and bounded (a realm may be hostile too)."""
    body = bytearray()
    try:
        body += response.content  # read already (a transport that is not streamed)
    except httpx.ResponseNotRead:
        try:
            for piece in response.iter_raw():
                body += piece
                if len(body) > TOKEN_BYTES_LIMIT:
                    return None
        except httpx.HTTPError:
            return None
        finally:
            response.close()
    if len(body) > TOKEN_BYTES_LIMIT:
        return None
    if response.status_code != 200:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    token = data.get("token") or data.get("access_token") if isinstance(data, dict) else None
    return token if isinstance(token, str) and token else None
