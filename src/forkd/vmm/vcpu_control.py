"""Stopping and starting a VM's vCPUs (QMP ``stop``/``cont``): :class:`Vcpus`, which
:class:`forkd.vmm.vm.VM` holds.

A pause first holds the agent channel (:meth:`AgentClient.hold`): nothing is
half sent to a guest that cannot read it any more, and no upload payload is
half read by a guest about to be snapshotted. The channel is released at the
resume, or when the pause fails.
"""

from __future__ import annotations

from collections.abc import Callable

from forkd import limits
from forkd.errors import AgentError, Busy, VMError
from forkd.states import VMState
from forkd.vmm.agent.client import AgentClient
from forkd.vmm.qemu.qmp import QMPChannel


class Vcpus:
    """One VM's vCPUs: ``set_state`` moves the VM's state once QEMU did as asked,
    ``raise_if_dead`` says so when it could not because it is gone."""

    def __init__(
        self,
        vm_id: str,
        agent: AgentClient,
        qmp: QMPChannel,
        set_state: Callable[[VMState], None],
        raise_if_dead: Callable[[str], None],
    ) -> None:
        self.id = vm_id
        self.agent = agent
        self.qmp = qmp
        self._set_state = set_state
        self._raise_if_dead = raise_if_dead

    async def pause(self) -> None:
        """Freeze the vCPUs, the agent channel held; :class:`Busy` when a request
        or an upload is still crossing it after ``AGENT_HOLD_SECS``."""
        try:
            await self.agent.hold(limits.AGENT_HOLD_SECS)
        except AgentError as exc:
            raise Busy(f"pausing {self.id}: {exc}; retry shortly") from exc
        try:
            await self._run_state("stop", "pausing", VMState.PAUSED)
        except BaseException:
            self.agent.release()
            raise

    async def resume(self) -> None:
        """Let the vCPUs run again, and requests cross the agent channel."""
        try:
            await self._run_state("cont", "resuming", VMState.RUNNING)
        finally:
            self.agent.release()

    async def _run_state(self, cmd: str, doing: str, state: VMState) -> None:
        try:
            await self.qmp.execute(cmd)
        except VMError as exc:
            self._raise_if_dead(f"QEMU of {self.id} died")
            raise VMError(f"{doing} {self.id} failed: {exc}") from exc
        self._set_state(state)
