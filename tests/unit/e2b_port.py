"""What the tests of forkd's E2B port share (the port itself is conftest's ``e2b_url``)."""

from __future__ import annotations

import httpx

from tests.unit.conftest import E2B_UPLOAD_LIMIT as UPLOAD_LIMIT
from tests.unit.conftest import TOKEN, Server

__all__ = ["UPLOAD_LIMIT", "forkd_client"]


def forkd_client(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"})
