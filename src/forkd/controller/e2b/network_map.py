"""E2B's ``network`` option (on create, and ``PUT /sandboxes/{id}/network``) as forkd's
network policy, which was modelled on it: ``allowOut``, ``denyOut`` and ``rules`` (a
host's header transforms) carry over; a rule's ``${e2b.secrets.NAME}`` is forkd's
``${secrets.NAME}``, filled by the egress proxy on the secret's own hosts only.
``allow_internet_access`` false is "deny everything". What forkd's proxy does not do
(a SOCKS5 ``egressProxy``, ``dnsServers``) is refused rather than silently dropped."""

from __future__ import annotations

import re
from typing import Any

from forkd.controller.e2b.models import validated
from forkd.controller.models.network import NetworkPolicy
from forkd.errors import Invalid

REFUSED = {
    "egressProxy": "a SOCKS5 egress proxy: forkd's egress proxy is its own",
    "dnsServers": "DNS servers: the egress proxy resolves names itself",
}
E2B_SECRET = re.compile(r"\$\{e2b\.secrets\.([A-Za-z0-9_-]+)\}")


def policy_of(network: dict[str, Any], allow_internet_access: bool | None = None) -> NetworkPolicy:
    """``network`` (E2B's JSON) as forkd's policy; Invalid for what it cannot honour."""
    for key, what in REFUSED.items():
        if network.get(key):
            raise Invalid(f"network.{key} is not supported by forkd: {what}")
    fields: dict[str, Any] = {
        "allow_out": network.get("allowOut"),
        "deny_out": network.get("denyOut"),
        "rules": _rules(network.get("rules")),
    }
    if allow_internet_access is False:
        fields["deny_out"] = ["*"]
    return validated(NetworkPolicy, fields, where="network.")


def _rules(rules: object) -> object:
    """E2B's rules with their secret placeholders in forkd's form."""
    if not isinstance(rules, dict):
        return rules
    return {host: _with_forkd_secrets(given) for host, given in rules.items()}


def _with_forkd_secrets(value: object) -> object:
    if isinstance(value, str):
        return E2B_SECRET.sub(lambda m: "${secrets." + m.group(1) + "}", value)
    if isinstance(value, list):
        return [_with_forkd_secrets(v) for v in value]
    if isinstance(value, dict):
        return {k: _with_forkd_secrets(v) for k, v in value.items()}
    return value
