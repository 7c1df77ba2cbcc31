"""Egress policies: what a request may ask for, and the rules each one loads."""

from __future__ import annotations

import ipaddress

import pytest

from forkd.errors import Invalid
from forkd.vmm.jail import egress
from forkd.vmm.jail.addresses import GUEST_IP
from forkd.vmm.jail.egress import BLOCKED_RANGES, Egress
from forkd.vmm.jail.rulesets import (
    ALWAYS_BLOCKED,
    host_ruleset,
    inside_clients_ruleset,
    namespace_ruleset,
)


def _egress_chain(rules: str) -> str:
    start = rules.index("chain egress {")
    return rules[start : rules.index("\n  }", start)]


@pytest.mark.parametrize(
    "value",
    [
        "all",
        "",
        None,
        1,
        {"allow": "10.0.0.0/8"},
        {"allow": [1]},
        {"deny": []},
        {"allow": ["bad host!"]},
        {"allow": ["x"] * 65},
    ],
)
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
    # The host still reaches the agent (and any guest port) through the DNAT.
    assert f'iifname "veth0" meta l4proto tcp dnat to {GUEST_IP}' in rules


def test_only_tcp_from_the_host_side_is_forwarded_to_any_guest_port() -> None:
    """The port proxy reaches every guest TCP port from the veth; nothing arriving
    from the guest's tap is turned back into the guest or to the host."""
    rules = namespace_ruleset(Egress("none"), resolver=None)
    dnats = [line.strip() for line in rules.splitlines() if "dnat to" in line]
    assert dnats == [f'iifname "veth0" meta l4proto tcp dnat to {GUEST_IP}']
    forward = rules[rules.index("chain forward") : rules.index("chain egress")]
    assert f'iifname "veth0" oifname "tap0" ip daddr {GUEST_IP} meta l4proto tcp accept' in forward
    assert 'iifname "tap0" oifname "veth0" jump egress' in forward  # the guest: egress only


def test_internet_drops_private_link_local_and_metadata_first() -> None:
    rules = namespace_ruleset(Egress("internet"), resolver=None)
    chain = _egress_chain(rules)
    final_accept = chain.rindex("accept")
    assert all(r in chain[:final_accept] for r in BLOCKED_RANGES)
    assert "169.254.0.0/16" in BLOCKED_RANGES and "10.0.0.0/8" in BLOCKED_RANGES
    assert chain.rstrip().endswith("drop")  # nothing falls through


def test_an_allow_list_opens_only_what_it_names() -> None:
    rules = namespace_ruleset(Egress("allow", ("10.9.0.0/16", "198.51.100.7")), resolver=None)
    chain = _egress_chain(rules)
    assert "10.9.0.0/16" in chain and "198.51.100.7/32" in chain
    assert "0.0.0.0/0" not in chain and chain.rstrip().endswith("drop")


def test_no_allow_entry_opens_metadata_or_loopback() -> None:
    rules = namespace_ruleset(Egress("allow", ("0.0.0.0/0", "169.254.169.254")), resolver=None)
    lines = _egress_chain(rules).splitlines()
    blocked = next(i for i, line in enumerate(lines) if ALWAYS_BLOCKED[2] in line)
    allowed = next(i for i, line in enumerate(lines) if "0.0.0.0/0" in line)
    assert lines[blocked].endswith("drop") and blocked < allowed


def test_a_hostname_never_opens_a_private_range(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only a literal CIDR may open a private range: a DNS answer is not the caller's word.
    answers = {"evil.example": ["169.254.169.254", "10.1.2.3", "198.51.100.9"]}
    monkeypatch.setattr(
        egress,
        "_lookup",
        lambda name: [ipaddress.IPv4Network(f"{a}/32") for a in answers[name]],
    )
    nets = Egress("allow", ("evil.example", "10.5.0.0/16")).resolve()
    assert [str(n) for n in nets] == ["198.51.100.9/32", "10.5.0.0/16"]


def test_the_guest_cannot_spoof_flood_or_smuggle() -> None:
    rules = namespace_ruleset(Egress("internet"), resolver=None)
    assert f'iifname "tap0" ip saddr != {GUEST_IP} drop' in rules
    assert f"arp saddr ip != {GUEST_IP} drop" in rules
    assert "ct state invalid drop" in rules
    assert "limit rate over" in rules and "ct count over" in rules


def test_the_host_fence_drops_sandbox_to_host_and_sandbox_to_sandbox() -> None:
    rules = host_ruleset("10.201.0.0/16")
    assert 'iifname "fkh-*" drop' in rules  # input: nothing new from a sandbox
    assert 'iifname "fkh-*" oifname "fkh-*" drop' in rules
    assert "ip saddr 10.201.0.0/16" in rules and "masquerade" in rules
    assert 'iifname "fkh-*" ip saddr != 10.201.0.0/16 drop' in rules
    # Of the host's users only the daemon's reaches a sandbox's agent port.
    assert 'oifname "fkh-*" meta skuid != 0 drop' in rules


def test_a_client_inside_the_namespace_reaches_the_guest_at_guest_addr() -> None:
    # ip netns exec forkd-<id> psql -h 10.201.0.2: the namespace's own packets, sent on
    # by the output hook; the guest's traffic never passes that hook.
    rules = inside_clients_ruleset("10.201.0.2")
    assert "type nat hook output priority -100" in rules
    assert "ip daddr 10.201.0.2 meta l4proto tcp dnat to 10.0.2.15" in rules
    assert "iifname" not in rules  # nothing keyed on the tap: the guest gains nothing


def test_the_hosts_own_networks_are_shut_whatever_the_policy_allows() -> None:
    """Issue 35: the host's LAN (here 192.0.2.0/24) is no private range, and SYNs to its
    gateway and to the host's own address there passed a sandbox's rules."""
    lan = [ipaddress.IPv4Network("192.0.2.0/24"), ipaddress.IPv4Network("192.0.2.254/32")]
    for policy in (Egress("internet"), Egress("allow", ("0.0.0.0/0", "192.0.2.0/24"))):
        chain = _egress_chain(namespace_ruleset(policy, resolver=None, host_nets=lan))
        shut = chain.index("ip daddr { 192.0.2.0/24, 192.0.2.254/32 } drop")
        assert shut < chain.index("accept"), chain  # before anything is let through


def test_the_hosts_networks_are_its_addresses_and_their_links_but_the_sandboxes() -> None:
    pytest.importorskip("pyroute2")
    import socket

    from pyroute2 import IPRoute

    from forkd.vmm.jail.network import host_networks

    sandboxes = ipaddress.IPv4Network("10.201.0.0/16")
    with IPRoute() as ipr:
        mine = [
            ipaddress.IPv4Interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}")
            for a in ipr.get_addr(family=socket.AF_INET)
        ]
    expected = {
        n
        for i in mine
        if not i.ip.is_loopback and i.ip not in sandboxes
        for n in (i.network, ipaddress.IPv4Network(f"{i.ip}/32"))
    }
    assert set(host_networks(sandboxes)) == expected
    assert host_networks(sandboxes, opened=(ipaddress.IPv4Network("0.0.0.0/0"),)) == []


def test_an_opened_range_inside_a_host_network_leaves_the_rest_shut() -> None:
    from forkd.vmm.jail.network import _without

    lan = ipaddress.IPv4Network("192.168.1.0/24")
    service = ipaddress.IPv4Network("192.168.1.10/32")
    left = _without({lan, ipaddress.IPv4Network("192.168.1.5/32")}, (service,))
    assert service not in left and not any(service.subnet_of(n) for n in left)
    assert sum(n.num_addresses for n in left) == 256 - 1 + 1  # the /24 less one, and .5
    assert _without({lan}, (ipaddress.IPv4Network("192.168.0.0/16"),)) == []


def test_with_the_proxy_every_dns_query_is_the_daemons() -> None:
    """No way around the daemon's answers: no DNAT to the host's resolver, no accept of
    anything sent to it straight, UDP to the guest's resolver redirected to the daemon."""
    from forkd.vmm.jail.addresses import DNS_PORT, PROXY_PORT

    rules = namespace_ruleset(Egress("internet"), resolver="192.0.2.53", proxy_port=PROXY_PORT)
    assert "192.0.2.53" not in rules
    assert f"udp dport 53 redirect to :{DNS_PORT}" in rules
    assert "tcp redirect to :15001" in rules
    shut = namespace_ruleset(Egress("none"), resolver="192.0.2.53", proxy_port=PROXY_PORT)
    assert "redirect" not in shut and "dport 53" not in shut


def test_a_new_policy_closes_a_named_connection_whose_address_it_now_denies() -> None:
    from forkd.egress.attachment import still_allowed
    from forkd.egress.decide import Fence

    fence = Fence.of("10.201.0.0/16", [])
    web = ipaddress.IPv4Address("198.51.100.7")
    assert still_allowed(Egress("internet"), fence, "api.test", web)
    assert not still_allowed(
        Egress.parse({"deny_out": ["198.51.100.0/24"]}), fence, "api.test", web
    )
    assert not still_allowed(Egress.parse({"allow_out": ["other.test"]}), fence, "api.test", web)
    assert still_allowed(Egress.parse({"allow_out": ["api.test"]}), fence, "api.test", web)
    assert not still_allowed(Egress.parse({"allow_out": ["api.test"]}), fence, None, web)
