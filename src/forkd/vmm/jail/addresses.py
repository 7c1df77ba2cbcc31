"""Where everything is in a sandbox's network: the same in every namespace.

The guest's address, its gateway's and its resolver's (the tap's network), the
ports the host and the daemon's egress proxy use there, the names of the links
and namespaces. :mod:`forkd.vmm.jail.network` makes the namespaces and
:mod:`forkd.vmm.jail.rulesets` writes their rules from these.
"""

from __future__ import annotations

GUEST_IP = "10.0.2.15"
GATEWAY_IP = "10.0.2.2"
DNS_IP = "10.0.2.3"
GUEST_NETWORK = "10.0.2.0/24"  # the tap's: the guest, its gateway and its resolver
AGENT_PORT = 8888
# The tap's MAC, the same in every namespace: a fork or a branch's child is a memory
# copy whose ARP cache may hold its parent's gateway; with a MAC of its own per tap,
# the copy's packets to the gateway went nowhere until that entry went stale.
TAP_MAC = "02:66:6b:64:00:02"
PROXY_PORT = 15001  # the egress proxy's listener in each namespace, on GATEWAY_IP
DNS_PORT = 5353  # ... and its DNS socket (UDP), where the guest's queries to DNS_IP go
DEFAULT_CIDR = "10.201.0.0/16"
HOST_IF_PREFIX = "fkh-"
NETNS_PREFIX = "forkd-"
NS_VETH = "veth0"
NS_TAP = "tap0"
