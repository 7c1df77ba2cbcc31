"""Egress policies: what a request may ask for, and the rules each one loads."""

from __future__ import annotations

import pytest

from forkd.errors import Invalid
from forkd.vmm import egress
from forkd.vmm.egress import BLOCKED_RANGES, Egress
from forkd.vmm.network import AGENT_PORT, GUEST_IP, host_ruleset, namespace_ruleset


def _egress_chain(rules: str) -> str:
    start = rules.index("chain egress {")
    return rules[start : rules.index("\n  }", start)]


@pytest.mark.parametrize(
    "value",
    ["all", "", None, 1, {"allow": "10.0.0.0/8"}, {"allow": [1]}, {"deny": []},
     {"allow": ["bad host!"]}, {"allow": ["x"] * 65}],
)  # fmt: skip
def test_bad_policies_are_refused(value: object) -> None:
    with pytest.raises(Invalid):
        Egress.parse(value)


def test_policies_round_trip() -> None:
    for value in ("none", "internet", {"allow": ["198.51.100.0/24", "pypi.org"]}):
        assert Egress.parse(value).to_json() == value
    assert egress.of_machine(None, True) == Egress("internet")
    assert egress.of_machine(None, False) == Egress("none")
    assert egress.of_machine({"allow": ["1.2.3.4"]}, True) == Egress("allow", ("1.2.3.4",))


def test_a_request_gives_egress_or_internet_not_both() -> None:
    assert egress.requested(None, None) is None
    assert egress.requested(None, False) == Egress("none")
    assert egress.requested("internet", None) == Egress("internet")
    with pytest.raises(Invalid):
        egress.requested("none", True)


def test_none_drops_every_new_connection_from_the_guest() -> None:
    rules = namespace_ruleset(Egress("none"), resolver="192.0.2.53")
    chain = _egress_chain(rules)
    assert "accept" not in chain  # nothing is let out, not even DNS
    assert "dport 53" not in rules
    # The host still reaches the agent through the DNAT.
    assert f"dnat to {GUEST_IP}:{AGENT_PORT}" in rules


def test_internet_drops_private_link_local_and_metadata_first() -> None:
    rules = namespace_ruleset(Egress("internet"), resolver=None)
    chain = _egress_chain(rules)
    drop_at = chain.index("drop")
    assert all(r in chain[:drop_at] for r in BLOCKED_RANGES)
    assert "169.254.0.0/16" in BLOCKED_RANGES and "10.0.0.0/8" in BLOCKED_RANGES
    assert chain.rstrip().endswith("drop")  # nothing falls through


def test_an_allow_list_opens_only_what_it_names() -> None:
    rules = namespace_ruleset(Egress("allow", ("10.9.0.0/16", "198.51.100.7")), resolver=None)
    chain = _egress_chain(rules)
    assert "10.9.0.0/16" in chain and "198.51.100.7/32" in chain
    assert "0.0.0.0/0" not in chain and chain.rstrip().endswith("drop")


def test_the_host_fence_drops_sandbox_to_host_and_sandbox_to_sandbox() -> None:
    rules = host_ruleset("10.201.0.0/16")
    assert 'iifname "fkh-*" drop' in rules  # input: nothing new from a sandbox
    assert 'iifname "fkh-*" oifname "fkh-*" drop' in rules
    assert "ip saddr 10.201.0.0/16" in rules and "masquerade" in rules
