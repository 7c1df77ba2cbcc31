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
    "rules": {"api.openai.com": [{"transform": {"headers": {
        "Authorization": "Bearer ${secrets.openai}"}}}]},
}  # fmt: skip


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
    for body, expected in (({"egress": "none"}, {"deny_out": ["*"]}),
                           ({"internet": True}, {}),
                           ({"internet": False}, {"deny_out": ["*"]}),
                           ({"egress": {"allow": ["pypi.org"]}}, {"allow_out": ["pypi.org"]}),
                           ({"network": {}}, {})):  # fmt: skip
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
