"""A guest call whose VM's QEMU ended while it waited: the sandbox is marked dead only
when that VM is still its own. A sandbox hibernated (or killed, or woken in a new VM)
while a call on its old VM waited keeps what that made of it: marking it dead would
throw its hibernated state away."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from forkd.controller.services.guest_calls import GuestCalls
from forkd.errors import AgentError, Conflict


class _Ended:
    """A VM whose QEMU has exited."""

    def is_alive(self) -> bool:
        return False


class _Vms(dict[str, Any]):
    def __init__(self) -> None:
        super().__init__()
        self.dead: list[str] = []

    def live(self, sandbox_id: str, paused_ok: bool = False) -> Any:
        return self[sandbox_id]

    async def mark_dead(self, sandbox_id: str) -> None:
        self.dead.append(sandbox_id)


def _calls(vms: _Vms) -> GuestCalls:
    return GuestCalls(vms, waker=None)  # type: ignore[arg-type]


def test_a_call_on_the_sandboxs_own_vm_that_ended_marks_it_dead() -> None:
    vms = _Vms()
    vms["sb-1"] = _Ended()

    async def call(vm: Any) -> None:
        raise AgentError("agent connection closed")

    with pytest.raises(Conflict, match="died"):
        asyncio.run(_calls(vms).call("sb-1", call, wake=False))
    assert vms.dead == ["sb-1"]


def test_a_call_whose_vm_was_hibernated_meanwhile_leaves_the_sandbox_be() -> None:
    vms = _Vms()
    vms["sb-1"] = _Ended()

    async def call(vm: Any) -> None:
        del vms["sb-1"]  # hibernation took the VM out of the running ones, then ended it
        raise AgentError("agent connection closed")

    with pytest.raises(Conflict, match="stopped or hibernated"):
        asyncio.run(_calls(vms).call("sb-1", call, wake=False))
    assert vms.dead == []
