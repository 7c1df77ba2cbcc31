"""A sandbox's network policy at runtime, and what its guest reached.

A change (``PATCH /v1/sandboxes/{id}/network``) is the proxy's table updated:
the next connection the guest opens is judged by it, and the open connections
it now denies are closed at once. It is recorded in the VM's machine (vm.json),
so a branch taken after it, a hibernation and a restarted daemon keep it. When
DNS opens or shuts with it (a policy that lets nothing out has none), the
namespace's rules are loaded again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from forkd.controller.models.network import EgressPage, EgressRecordInfo, NetworkInfo, NetworkPolicy
from forkd.egress.records import EgressRecord
from forkd.errors import Conflict
from forkd.states import SandboxState
from forkd.vmm.jail import egress
from forkd.vmm.jail.egress import Egress
from forkd.vmm.snapshot import files as snapshot_files

if TYPE_CHECKING:
    from forkd.controller.services.events import EventBus
    from forkd.controller.services.hibernated_files import HibernatedFiles
    from forkd.controller.services.launcher import Launcher
    from forkd.controller.services.live_vms import LiveVMs
    from forkd.controller.services.records import Records
    from forkd.controller.services.sandbox_vm import SandboxVM
    from forkd.egress.proxy import EgressProxy

log = logging.getLogger(__name__)
MAX_PAGE = 1000


class NetworkService:
    def __init__(
        self,
        events: EventBus,
        hibernated: HibernatedFiles,
        records: Records,
        vms: LiveVMs,
        launcher: Launcher,
        egress: EgressProxy,
    ) -> None:
        self.events = events
        self.hibernated = hibernated
        self.rows = records
        self.vms = vms
        self.launcher = launcher
        self.egress = egress
        self._changing: dict[str, asyncio.Lock] = {}

    def policy(self, sandbox_id: str) -> Egress:
        """The policy of ``sandbox_id`` now: the proxy's, its VM's, or (hibernated) the one
        its state on disk holds."""
        row = self.rows.sandbox_row(sandbox_id)
        vm = self.vms.get(sandbox_id)
        if vm is not None:
            return self.live_policy(sandbox_id, vm)
        asleep = (
            self.hibernated.latest(sandbox_id) if row.state == SandboxState.HIBERNATED else None
        )
        if asleep is not None:
            machine = snapshot_files.load(asleep).machine
            return egress.of_machine(machine.egress, machine.internet)
        raise Conflict(f"sandbox {sandbox_id!r} is {row.state}: it has no network")

    def live_policy(self, sandbox_id: str, vm: SandboxVM) -> Egress:
        """The policy of a sandbox with a VM: the proxy's, else (no proxy) its machine's."""
        held = self.egress.policy_of(sandbox_id)
        if held is not None:
            return held
        return egress.of_machine(vm.machine.egress, vm.machine.internet)

    def rules_naming(self, secret: str) -> list[str]:
        """The running sandboxes whose network rules name ``secret`` (a placeholder in one
        of their transforms)."""
        needle = "${secrets." + secret + "}"
        return [
            sandbox_id
            for sandbox_id, vm in list(self.vms.items())
            if any(
                needle in value
                for _, rules in self.live_policy(sandbox_id, vm).rules
                for rule in rules
                for _, value in rule.headers
            )
        ]

    def info(self, sandbox_id: str, closed: int | None = None) -> NetworkInfo:
        policy = self.policy(sandbox_id)
        vm = self.vms.get(sandbox_id)
        proxied = self.launcher.network.egress is not None and vm is not None and vm.net is not None
        return NetworkInfo(**policy.network(), proxied=proxied, closed=closed)

    async def update(self, sandbox_id: str, body: NetworkPolicy) -> NetworkInfo:
        """Replace the policy of a running or paused sandbox (a hibernated one: 409)."""
        new = egress.requested(None, None, body)
        assert new is not None
        lock = self._changing.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            vm = self.vms.live(sandbox_id, paused_ok=True)
            old = self.policy(sandbox_id)
            vm.set_egress(new)
            closed = self.egress.set_policy(sandbox_id, new)
            kernel_decides = self.launcher.network.egress is None  # --egress-proxy off
            if (
                vm.net is not None
                and self.launcher.network.enabled
                and (old.shut != new.shut or kernel_decides)
            ):
                await asyncio.to_thread(self.launcher.network.reload, vm.net, new)
        self.events.publish(
            "network_changed", sandbox_id=sandbox_id, closed=closed, **new.network()
        )
        log.info("sandbox %s: network policy changed (%d connections closed)", sandbox_id, closed)
        return self.info(sandbox_id, closed)

    def records(self, sandbox_id: str, after: int, limit: int) -> EgressPage:
        self.rows.sandbox_row(sandbox_id)
        found = self.egress.log.of(sandbox_id, after, min(limit, MAX_PAGE))
        shown = [record_info(r) for r in found]
        return EgressPage(records=shown, next_after=shown[-1].id if shown else after)


def record_info(record: EgressRecord) -> EgressRecordInfo:
    fields = record.to_json()
    fields.pop("sandbox_id")
    return EgressRecordInfo(**fields)
