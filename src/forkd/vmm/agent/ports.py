"""Where the host reaches a TCP port of a VM's guest: :class:`HostForwards`, which
:class:`forkd.vmm.vm.VM` holds.

With a network namespace the guest's ports are at the namespace's address
(DNAT to the guest inside it: :func:`forkd.vmm.jail.rulesets.namespace_ruleset`).
With user-mode networking QEMU forwards a loopback port the daemon picks to
the guest port (HMP ``hostfwd_add`` over QMP), added on first use and kept
for the VM's life. Either way the connection starts on the host: nothing in
the guest can open one back to the daemon.
"""

from __future__ import annotations

import asyncio
import socket

from forkd.errors import Invalid, VMError
from forkd.vmm.jail.addresses import AGENT_PORT
from forkd.vmm.jail.network import SandboxNet
from forkd.vmm.qemu.argv import NETDEV_ID
from forkd.vmm.qemu.qmp import QMPChannel

LOOPBACK = "127.0.0.1"
HOSTFWD_ATTEMPTS = 5  # a port picked free may be taken before QEMU binds it


def check_guest_port(port: int) -> None:
    """:class:`Invalid` unless ``port`` is a TCP port a caller may reach in a guest."""
    if not 1 <= port <= 65535:
        raise Invalid(f"port {port} is not a TCP port (1-65535)")
    if port == AGENT_PORT:
        raise Invalid(
            f"port {AGENT_PORT} is the forkd guest agent's, not a service of yours: it speaks "
            "forkd's own protocol and is never proxied (use the sandbox routes instead)"
        )


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class HostForwards:
    """One VM's guest ports as the host reaches them; with user-mode networking, the
    loopback ports QEMU forwards, added at first use and kept for the VM's life."""

    def __init__(self, vm_id: str, qmp: QMPChannel) -> None:
        self.id = vm_id
        self.qmp = qmp
        self._forwards: dict[int, int] = {}  # guest port -> the loopback port to it
        self._lock = asyncio.Lock()

    async def address(self, port: int, net: SandboxNet | None) -> tuple[str, int]:
        """The host and port the daemon connects to for guest TCP port ``port`` (at
        the namespace's address with ``net``)."""
        check_guest_port(port)
        if net is not None:
            return net.ns_ip, port
        async with self._lock:
            if port not in self._forwards:
                self._forwards[port] = await self._add_host_forward(port)
        return LOOPBACK, self._forwards[port]

    async def _add_host_forward(self, port: int) -> int:
        """A new loopback port that QEMU forwards to guest ``port``."""
        said = ""
        for _ in range(HOSTFWD_ATTEMPTS):
            host_port = _free_loopback_port()
            rule = f"tcp:{LOOPBACK}:{host_port}-:{port}"
            said = await self.qmp.execute(
                "human-monitor-command", {"command-line": f"hostfwd_add {NETDEV_ID} {rule}"}
            )
            if not str(said).strip():  # HMP says nothing when it worked
                return host_port
        raise VMError(
            f"QEMU of {self.id} could not forward a host port to guest port "
            f"{port}: {str(said).strip()}"
        )
