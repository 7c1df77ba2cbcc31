"""The nftables rulesets that fence sandboxes in, as text each loaded whole.

A namespace's own (:func:`namespace_ruleset`: the agent's DNAT, masquerade, the
guest's limits and its ``egress`` chain, and with the egress proxy the redirects
to it), what a client started inside a namespace needs
(:func:`inside_clients_ruleset`), and the host's ``forkd`` table
(:func:`host_ruleset`). :mod:`forkd.vmm.jail.network` loads them; nothing here
touches the host.
"""

from __future__ import annotations

import ipaddress

from forkd.vmm.jail.addresses import (
    DNS_IP,
    DNS_PORT,
    GATEWAY_IP,
    GUEST_IP,
    HOST_IF_PREFIX,
    NS_TAP,
    NS_VETH,
)
from forkd.vmm.jail.egress import BLOCKED_RANGES, Egress

HOST_TABLE = "forkd"
NEW_CONN_RATE = 500  # new connections a guest may open per second (burst below)
NEW_CONN_BURST = 1000
MAX_GUEST_CONNS = 4096  # its connections tracked at once: the host's table is shared
ALWAYS_BLOCKED = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3")


def namespace_ruleset(
    egress: Egress,
    resolver: str | None,
    host_nets: list[ipaddress.IPv4Network] | None = None,
    proxy_port: int | None = None,
) -> str:
    """The namespace's own rules: agent DNAT, masquerade, and the egress chain.

    Whatever the policy, the guest may use only its own address (no spoofing),
    its ARP must claim that address (no neighbour-table flooding), nothing
    conntrack calls invalid leaves, and new connections are rate-limited and
    counted, so one guest cannot fill the host's conntrack table. Nor does it reach
    ``host_nets`` (:func:`forkd.vmm.jail.network.host_networks`), whatever its policy allows.

    With ``proxy_port`` (the daemon's egress proxy), every TCP connection the guest
    opens is redirected to the proxy's listener on the gateway address, which
    decides by name; the egress chain then lets only DNS through, and the proxy's
    own connections out (the namespace's output) never reach ``host_nets`` or what
    is always blocked. A policy that lets nothing out redirects nothing.
    """
    port = proxy_port if proxy_port is not None and not egress.shut else None
    dns = resolver if not egress.shut else None
    lines = [
        "flush ruleset",
        "table arp forkd {",
        "  chain input {",
        "    type filter hook input priority filter; policy accept;",
        f'    iifname "{NS_TAP}" arp saddr ip != {GUEST_IP} drop',
        "  }",
        "}",
        "table ip forkd {",
        *_prerouting(dns, port),
        "  chain postrouting {",
        "    type nat hook postrouting priority srcnat; policy accept;",
        f'    oifname "{NS_VETH}" masquerade',
        "  }",
        *_filters(port),
    ]
    if proxy_port is not None:  # the proxy's connections out, whatever it decided
        shut = [*ALWAYS_BLOCKED, *(str(n) for n in host_nets or ())]
        lines += [
            "  chain upstream {",  # (the nat "output" chain is inside_clients_ruleset's)
            "    type filter hook output priority filter; policy accept;",
            f'    oifname "{NS_VETH}" ip daddr {{ {", ".join(shut)} }} drop',
            "  }",
        ]
    lines += [*_egress_chain(egress, dns, host_nets, proxied=proxy_port is not None), "}"]
    return "\n".join(lines) + "\n"


def _prerouting(dns: str | None, proxy_port: int | None) -> list[str]:
    lines = [
        "  chain prerouting {",
        "    type nat hook prerouting priority dstnat; policy accept;",
        # From the host (only the daemon's uid may send here): any TCP port of the
        # guest, its agent's and the ports the daemon proxies (forkd.vmm.agent.ports).
        f'    iifname "{NS_VETH}" meta l4proto tcp dnat to {GUEST_IP}',
    ]
    if proxy_port is not None:  # the daemon answers UDP queries itself (forkd.egress.dns)
        lines.append(
            f'    iifname "{NS_TAP}" ip daddr {DNS_IP} udp dport 53 redirect to :{DNS_PORT}'
        )
    if dns and proxy_port is None:  # without the proxy, the host's resolver answers
        for proto in ("udp", "tcp"):
            lines.append(
                f'    iifname "{NS_TAP}" ip daddr {DNS_IP} {proto} dport 53 dnat to {dns}:53'
            )
    if proxy_port is not None:
        lines.append(f'    iifname "{NS_TAP}" meta l4proto tcp redirect to :{proxy_port}')
    return [*lines, "  }"]


def _filters(proxy_port: int | None) -> list[str]:
    """The input chain (the guest talks to nothing of the namespace's but the proxy) and
    the forward chain, each with the guest's limits."""
    guest_limits = [
        f'    iifname "{NS_TAP}" ip saddr != {GUEST_IP} drop',
        f'    iifname "{NS_TAP}" ct state new limit rate over {NEW_CONN_RATE}/second '
        f"burst {NEW_CONN_BURST} packets drop",
        f'    iifname "{NS_TAP}" ct state new ct count over {MAX_GUEST_CONNS} drop',
    ]
    lines = [
        "  chain input {",
        "    type filter hook input priority filter; policy drop;",
        "    ct state invalid drop",
        "    ct state established,related accept",
        '    iifname "lo" accept',
    ]
    if proxy_port is not None:
        to_proxy = f'    iifname "{NS_TAP}" ip daddr {GATEWAY_IP} tcp dport {proxy_port} accept'
        to_dns = f'    iifname "{NS_TAP}" ip daddr {GATEWAY_IP} udp dport {DNS_PORT} accept'
        lines += [*guest_limits, to_proxy, to_dns]
    return [
        *lines,
        "  }",
        "  chain forward {",
        "    type filter hook forward priority filter; policy drop;",
        "    ct state invalid drop",
        "    ct state established,related accept",
        *guest_limits,
        f'    iifname "{NS_VETH}" oifname "{NS_TAP}" ip daddr {GUEST_IP} meta l4proto tcp accept',
        f'    iifname "{NS_TAP}" oifname "{NS_VETH}" jump egress',
        "  }",
    ]


def _egress_chain(
    egress: Egress,
    dns: str | None,
    host_nets: list[ipaddress.IPv4Network] | None,
    *,
    proxied: bool,
) -> list[str]:
    """What the guest's forwarded packets may reach: DNS, and without the proxy what the
    policy allows by address."""
    allowed = egress.resolve() if egress.mode == "allow" and not proxied else []
    lines = ["  chain egress {"]
    if dns and not proxied:  # (with the proxy, the daemon answers: nothing goes straight)
        lines.append(f"    ip daddr {dns} meta l4proto {{ udp, tcp }} th dport 53 accept")
    # Link-local (metadata), loopback and multicast stay shut whatever is allowed, and so
    # do the host's own networks and addresses (unless the operator opened them).
    lines.append(f"    ip daddr {{ {', '.join(ALWAYS_BLOCKED)} }} drop")
    if host_nets:
        lines.append(f"    ip daddr {{ {', '.join(str(n) for n in host_nets)} }} drop")
    if denied := egress.denied_networks():
        lines.append(f"    ip daddr {{ {', '.join(str(n) for n in denied)} }} drop")
    if allowed:
        lines.append(f"    ip daddr {{ {', '.join(str(n) for n in allowed)} }} accept")
    if egress.mode == "internet" and not proxied and not egress.shut:
        lines.append(f"    ip daddr {{ {', '.join(BLOCKED_RANGES)} }} drop")
        lines.append("    accept")
    return [*lines, "    drop", "  }"]


def inside_clients_ruleset(ns_ip: str) -> str:
    """Rules added to the namespace's: a client started inside it (``ip netns exec
    forkd-<id> psql -h <ns_ip>``, as the original forkd's recipes do) reaches the guest
    at ``guest_addr``'s host, any TCP port, as the host does.

    Its packets are the namespace's own: they never pass prerouting (whose DNAT takes
    what the host sends), so the output hook sends them on. Only processes in the
    namespace make such packets (root with ``ip netns exec``, or the daemon); the
    guest's traffic enters through the tap and never meets this hook, so it opens
    nothing to the guest.
    """
    return (
        "\n".join(
            [
                "table ip forkd {",
                "  chain output {",
                # -100 is dstnat's priority, given by number for nft 1.0
                "    type nat hook output priority -100; policy accept;",
                f"    ip daddr {ns_ip} meta l4proto tcp dnat to {GUEST_IP}",
                "  }",
                "}",
            ]
        )
        + "\n"
    )


def host_ruleset(cidr: str, daemon_uid: int = 0) -> str:
    """The host's ``forkd`` table: sandboxes reach neither the host nor each other,
    and of the host's users only the daemon's reaches them (their agents run code)."""
    sb = f'"{HOST_IF_PREFIX}*"'
    return f"""add table ip {HOST_TABLE}
delete table ip {HOST_TABLE}
table ip {HOST_TABLE} {{
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname {sb} ct state established,related accept
    iifname {sb} drop
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname {sb} ct state invalid drop
    iifname {sb} ip saddr != {cidr} drop
    iifname {sb} oifname {sb} drop
    oifname {sb} ct state established,related accept
    oifname {sb} drop
  }}
  chain output {{
    type filter hook output priority filter - 10; policy accept;
    oifname {sb} meta skuid != {daemon_uid} drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {cidr} oifname != {sb} masquerade
  }}
}}
"""
