"""The API key of E2B's form (``e2b_`` and 40 hex digits) that stands for a daemon's
bearer token on its E2B port (``forkd token --e2b``): for users of E2B's SDKs who keep
E2B's key check on. Derived from the token, so it changes with it and tells nothing of
it. Standard library only (the CLI prints it without the daemon's dependencies)."""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "e2b_"


def e2b_key(token: str) -> str:
    digest = hmac.new(token.encode(), b"forkd e2b api key", hashlib.sha256).hexdigest()
    return PREFIX + digest[:40]
