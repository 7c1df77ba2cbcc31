"""E2B's secrets through E2B's own SDK, against forkd's E2B port: they are forkd's
secrets (write-only, sealed, put in by the egress proxy on their own hosts only), so a
secret names its hosts in its metadata and one without is refused."""

from __future__ import annotations

import e2b
import pytest

from tests.unit.conftest import Server
from tests.unit.e2b_port import forkd_client


def test_a_secret_made_through_e2b_is_forkds_with_its_hosts(server: Server, e2b_url: str) -> None:
    made = e2b.Secret.create("openai", "sk-e2b-0123456789", metadata={"hosts": "api.openai.com"})
    assert (made.secret_id, made.name) == ("openai", "openai")
    with forkd_client(server) as c:
        mine = c.get("/v1/secrets/openai").json()
    assert mine["hosts"] == ["api.openai.com"] and "value" not in mine  # write-only
    assert e2b.Secret.get_info("openai").metadata == {"hosts": "api.openai.com"}
    assert [s.name for s in e2b.Secret.list().next_items()] == ["openai"]
    e2b.Secret.update("openai", "sk-e2b-rotated-000000", metadata={"hosts": "*.openai.com"})
    with forkd_client(server) as c:
        assert c.get("/v1/secrets/openai").json()["hosts"] == ["*.openai.com"]
    with pytest.raises(e2b.SecretException, match="own hosts"):  # no hosts: refused
        e2b.Secret.create("nohosts", "value-1234567890")
    assert e2b.Secret.exists("nohosts") is False
    assert e2b.Secret.destroy("openai") is True
    assert e2b.Secret.exists("openai") is False
