"""The ``network`` object on forks and templates, and the older forms beside it: each
becomes the policy the VM driver is given, bad ones a 400 that changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd.vmm.jail.egress import Egress
from tests.unit.fakes import FakeDriver

POLICY = {
    "allow_out": ["api.openai.com", "*.GitHub.com.", "203.0.113.0/24"],
    "deny_out": ["evil.github.com"],
    "rules": {
        "api.openai.com": [
            {"transform": {"headers": {"Authorization": "Bearer ${secrets.openai}"}}}
        ]
    },
}


@pytest.fixture
def py(client: TestClient) -> str:
    assert client.post("/v1/snapshots", json={"tag": "py"}).status_code == 201
    return "py"


def _fork(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/sandboxes", json={"snapshot_tag": "py", **body})


def test_a_forks_network_object_is_its_policy(
    client: TestClient, driver: FakeDriver, py: str
) -> None:
    assert _fork(client, network=POLICY).status_code == 201
    policy = driver.restore_kwargs[-1]["egress_policy"]
    assert isinstance(policy, Egress)
    assert policy.network() == {
        "allow_out": ["api.openai.com", "*.github.com", "203.0.113.0/24"],
        "deny_out": ["evil.github.com"],
        "rules": POLICY["rules"],
    }
    assert policy.allows_name("x.github.com") and not policy.allows_name("evil.github.com")
    assert not policy.allows_name("github.com")  # the wildcard is for what is below it


def test_the_older_forms_are_the_same_policies(
    client: TestClient, driver: FakeDriver, py: str
) -> None:
    for body, expected in (
        ({"egress": "none"}, {"deny_out": ["*"]}),
        ({"internet": True}, {}),
        ({"internet": False}, {"deny_out": ["*"]}),
        ({"egress": {"allow": ["pypi.org"]}}, {"allow_out": ["pypi.org"]}),
        ({"network": {}}, {}),
    ):
        assert _fork(client, **body).status_code == 201
        given = driver.restore_kwargs[-1]["egress_policy"]
        assert given.network() == {"allow_out": [], "deny_out": [], "rules": {}, **expected}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"network": {"allow_out": ["not a host!"]}}, "allow_out"),
        ({"network": {"deny_out": ["*.-x"]}}, "deny_out"),
        ({"network": {"rules": {"10.0.0.1": [{"transform": {"headers": {"A": "b"}}}]}}}, "names"),
        (
            {"network": {"rules": {"a.test": [{"transform": {"headers": {"Bad Name": "b"}}}]}}},
            "header name",
        ),
        (
            {"network": {"rules": {"a.test": [{"transform": {"headers": {"A": "b\nc"}}}]}}},
            "visible ASCII",
        ),
        ({"network": {"allow_out": ["a.test"]}, "egress": "none"}, "not network and egress"),
        ({"network": {"allow_out": ["a.test"]}, "internet": True}, "not network and internet"),
        ({"network": {"allow_out": ["a.test"], "block": []}}, "unknown field"),
        (
            {"network": {"rules": {"a.test": [{"transform": {"headers": {"A": "b "}}}]}}},
            "either end",
        ),
        (
            {"network": {"rules": {"a.test": [{"transform": {"headers": {"Host": "b"}}}]}}},
            "the proxy's to send",
        ),
    ],
)
def test_a_bad_network_object_is_refused_and_forks_nothing(
    client: TestClient, driver: FakeDriver, py: str, body: dict[str, Any], says: str
) -> None:
    answer = _fork(client, **body)
    assert answer.status_code == 400, answer.text
    assert says in answer.json()["error"]
    assert client.get("/v1/sandboxes").json() == []


def test_a_templates_network_object_is_recorded_for_its_forks(
    client: TestClient, driver: FakeDriver
) -> None:
    made = client.post("/v1/snapshots", json={"tag": "agent", "network": POLICY})
    assert made.status_code == 201, made.text
    policy = driver.boot_kwargs[-1]["egress_policy"]  # the template's VM: its snapshot's
    assert policy.network()["deny_out"] == ["evil.github.com"]
    assert Egress.parse(policy.to_json()) == policy  # as snapshot.json keeps it


# -- at runtime --------------------------------------------------------------------


def test_a_running_sandboxs_policy_is_replaced_and_recorded_with_its_vm(
    client: TestClient, driver: FakeDriver, py: str
) -> None:
    [sb] = _fork(client).json()
    assert client.get(f"/v1/sandboxes/{sb['id']}/network").json()["allow_out"] == []
    changed = client.patch(f"/v1/sandboxes/{sb['id']}/network", json={"deny_out": ["*"]})
    assert changed.status_code == 200, changed.text
    assert changed.json()["deny_out"] == ["*"] and changed.json()["closed"] == 0
    vm = driver.vms[-1]
    assert Egress.parse(vm.machine.egress).shut  # a branch, a hibernation take it from here
    shown = client.get(f"/v1/sandboxes/{sb['id']}/network").json()
    assert shown["deny_out"] == ["*"] and "closed" not in shown
    events = client.app.state.services.events  # type: ignore[attr-defined]
    assert any(e.type == "network_changed" for e in events._ring)


def test_what_a_policy_change_refuses(client: TestClient, py: str) -> None:
    [sb] = _fork(client).json()
    bad = client.patch(f"/v1/sandboxes/{sb['id']}/network", json={"allow_out": ["bad host!"]})
    assert bad.status_code == 400 and "allow_out" in bad.json()["error"]
    assert client.get(f"/v1/sandboxes/{sb['id']}/network").json()["allow_out"] == []
    assert client.patch("/v1/sandboxes/sb-nope-0001/network", json={}).status_code == 404
    assert (
        client.post(f"/v1/sandboxes/{sb['id']}/pause", json={"hibernate": True}).status_code == 200
    )
    asleep = client.patch(f"/v1/sandboxes/{sb['id']}/network", json={"deny_out": ["*"]})
    assert asleep.status_code == 409 and "hibernated" in asleep.json()["error"]
    assert client.get(f"/v1/sandboxes/{sb['id']}/network").status_code == 200  # its state's


def test_a_secret_named_by_a_sandboxs_rules_is_kept(client: TestClient, py: str) -> None:
    secret = {"name": "openai", "value": "sk-0123456789", "hosts": ["api.openai.com"]}
    assert client.post("/v1/secrets", json=secret).status_code == 201
    [sb] = _fork(client, network=POLICY).json()
    refused = client.delete("/v1/secrets/openai")
    assert refused.status_code == 409 and sb["id"] in refused.json()["error"]
    client.patch(f"/v1/sandboxes/{sb['id']}/network", json={"allow_out": ["api.openai.com"]})
    assert client.delete("/v1/secrets/openai").status_code == 204  # its rules are gone


def test_egress_records_are_paged_and_counted_in_metrics(client: TestClient, py: str) -> None:
    from forkd.egress.records import EgressRecord

    [sb] = _fork(client).json()
    log = client.app.state.services.egress.proxy.log  # type: ignore[attr-defined]
    for i in range(5):
        log.add(
            EgressRecord(
                sb["id"],
                "refused" if i % 2 else "allowed",
                "tls",
                f"h{i}.test",
                443,
                bytes_out=10,
                bytes_in=20,
            )
        )
    first = client.get(f"/v1/sandboxes/{sb['id']}/egress", params={"limit": 2}).json()
    assert [r["host"] for r in first["records"]] == ["h0.test", "h1.test"]
    rest = client.get(
        f"/v1/sandboxes/{sb['id']}/egress", params={"after": first["next_after"]}
    ).json()
    assert [r["host"] for r in rest["records"]] == ["h2.test", "h3.test", "h4.test"]
    metrics = client.get("/metrics").text
    assert f'forkd_sandbox_egress_allowed_total{{sandbox="{sb["id"]}"}} 3\n' in metrics
    assert f'forkd_sandbox_egress_refused_total{{sandbox="{sb["id"]}"}} 2\n' in metrics
    events = client.app.state.services.events  # type: ignore[attr-defined]
    assert sum(e.type == "egress" for e in events._ring) == 5
    assert client.get("/v1/sandboxes/sb-nope-0001/egress").status_code == 404


def test_refusals_reach_the_audit_log_and_a_flood_is_summed_up(
    client: TestClient, py: str, settings: Any
) -> None:
    import json as json_

    from forkd.controller.services import egress_audit
    from forkd.egress.records import EgressRecord

    [sb] = _fork(client).json()
    log = client.app.state.services.egress.proxy.log  # type: ignore[attr-defined]
    log.add(EgressRecord(sb["id"], "allowed", "tls", "ok.test", 443))
    for _ in range(egress_audit.AUDIT_REFUSALS_PER_SEC + 5):
        log.add(EgressRecord(sb["id"], "refused", "tls", "evil.test", 443, reason="denied"))
    lines = [
        json_.loads(line) for line in (settings.state_dir / "audit.log").read_text().splitlines()
    ]
    refused = [r for r in lines if r.get("event") == "egress_refused"]
    assert refused and all(r["sandbox_id"] == sb["id"] for r in refused)
    assert refused[0]["host"] == "evil.test" and refused[0]["reason"] == "denied"
    assert len(refused) <= egress_audit.AUDIT_REFUSALS_PER_SEC + 1  # then one summary
    assert not any(r.get("host") == "ok.test" for r in lines)  # allowed ones: records only
