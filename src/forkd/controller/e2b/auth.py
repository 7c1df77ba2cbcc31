"""Who may call the E2B port: E2B's API key (``X-API-KEY``) is the daemon's bearer token,
or the key of E2B's form made of it (``forkd token --e2b``); a sandbox's in-guest
daemon takes the access token that sandbox's creation answered (see :mod:`.envd`)."""

from __future__ import annotations

import hmac

from forkd.e2b_key import e2b_key
from forkd.errors import Unauthorized


def check_api_key(given: str | None, token: str | None) -> None:
    """:class:`Unauthorized` unless ``given`` is the daemon's ``token`` or its E2B key
    (``token`` None: the daemon runs with --insecure-no-auth)."""
    if token is None:
        return
    if not given:
        raise Unauthorized("no X-API-KEY header: the daemon's token (or forkd token --e2b)")
    for key in (token, e2b_key(token)):
        if hmac.compare_digest(key.encode(), given.encode()):
            return
    raise Unauthorized("that X-API-KEY is not this daemon's")
