"""``sandbox.get_host(port)`` of E2B's SDK against forkd's E2B port with fake VMs: the
host it names reaches the guest's port through the daemon's port proxy, with E2B's
traffic token (the sandbox's own, none other), on an origin of its own; the daemon's
credentials never reach the guest."""

from __future__ import annotations

import e2b
import httpx

from tests.unit import port_fixtures
from tests.unit.conftest import Server

web = port_fixtures.web
GUEST_PORT = port_fixtures.GUEST_PORT


def test_get_host_reaches_the_guests_port_with_the_traffic_token(
    server: Server, e2b_url: str, web: int
) -> None:
    sbx = e2b.Sandbox.create("base")
    port_fixtures.vm(server, sbx.sandbox_id).ports[GUEST_PORT] = web
    host = sbx.get_host(GUEST_PORT)
    assert host == f"{GUEST_PORT}-{sbx.sandbox_id}.localhost:{e2b_url.rsplit(':', 1)[1]}"
    token = {"E2B-Traffic-Access-Token": sbx.traffic_access_token or ""}
    answer = httpx.get(f"{e2b_url}/some/page?q=1", headers={"Host": host, **token})
    assert answer.status_code == 200 and "hello from the fake guest" in answer.text
    assert "/some/page?q=1" in answer.text  # the guest's paths are the host's own
    seen = httpx.get(f"{e2b_url}/headers", headers={"Host": host, **token}).json()
    lowered = {k.lower() for k, _ in seen}  # the headers as the guest got them, in pairs
    assert "authorization" not in lowered and "e2b-traffic-access-token" not in lowered

    assert httpx.get(f"{e2b_url}/", headers={"Host": host}).status_code == 401
    other = e2b.Sandbox.create("base")
    wrong = {"E2B-Traffic-Access-Token": other.traffic_access_token or ""}
    assert httpx.get(f"{e2b_url}/", headers={"Host": host, **wrong}).status_code == 502
    gone = host.replace(sbx.sandbox_id, "sb-nope-0")  # as a wrong token: nothing told
    assert httpx.get(f"{e2b_url}/", headers={"Host": gone, **token}).status_code == 502
    # Only the port proxy is reached: the daemon's route beside it is not.
    made = httpx.post(f"{e2b_url}/url", headers={"Host": host, **token})
    assert made.status_code != 201 and "token" not in made.text, made.text  # the guest's
    # The API on the same port is untouched by the guest hosts.
    assert e2b.Sandbox.get_info(sbx.sandbox_id).sandbox_id == sbx.sandbox_id
    other.kill()
    sbx.kill()


def test_e2bs_routing_headers_reach_any_other_guest_port(
    server: Server, e2b_url: str, web: int
) -> None:
    sbx = e2b.Sandbox.create("base")
    port_fixtures.vm(server, sbx.sandbox_id).ports[GUEST_PORT] = web
    routed = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(GUEST_PORT)}
    token = {"X-Access-Token": sbx._envd_access_token or ""}
    answer = httpx.get(f"{e2b_url}/hello", headers={**routed, **token})
    assert answer.status_code == 200 and "hello from the fake guest" in answer.text
    assert httpx.get(f"{e2b_url}/hello", headers=routed).status_code == 401
    closed = httpx.get(f"{e2b_url}/", headers={**routed, "E2b-Sandbox-Port": "8999", **token})
    assert closed.status_code == 502  # nothing listens there
    # envd's own port stays envd's
    envd = {**routed, "E2b-Sandbox-Port": "49983", **token}
    assert httpx.get(f"{e2b_url}/health", headers=envd).status_code == 204
    sbx.kill()
