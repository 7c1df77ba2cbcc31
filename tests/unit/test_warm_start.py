"""A pooled VM's warm-up (:func:`warm_start.prewarm`), in order, on a stub VM: restore,
one exec (so a claimed child's first command finds its path translated), stop;
a warm-up that fails leaves nothing running; an image without the command is only
less warm."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from forkd.agent_wire import ExecAnswer, RestoreAnswer
from forkd.errors import VMError
from forkd.states import VMState
from forkd.vmm.vm_state import VMLifecycle
from forkd.vmm.warm_start import WARM_EXEC, prewarm


class _QMP:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def execute(self, cmd: str, args: Any = None) -> None:
        self.calls.append(cmd)


class _StubVM(VMLifecycle):
    def __init__(self, exit_code: int = 0, exec_fails: bool = False) -> None:
        self.id, self.pid = "sb-1", 0
        self.ready_ms: float | None = None
        self.seed: int | None = None
        self._set_state(VMState.INCOMING)
        self.calls: list[str] = []
        self.qmp = _QMP(self.calls)
        self._exit_code = exit_code
        self._exec_fails = exec_fails

    async def finish_restore(self, **kw: Any) -> None:
        self.calls.append("restore")
        self._set_state(VMState.RUNNING)

    async def exec(self, argv: list[str], **kw: Any) -> ExecAnswer:
        self.calls.append("exec " + " ".join(argv))
        if self._exec_fails:
            raise VMError("agent gone")
        return {"exit_code": self._exit_code, "stdout": "", "stderr": ""}

    async def make_unique(
        self, hostname: str, wait: float, *, seed: int | None = None
    ) -> RestoreAnswer:
        return {"rng_reseeded": True, "random_reseeded": True}

    @property
    def guest(self) -> _StubVM:  # the stub plays its guest too
        return self

    async def kill(self) -> None:
        self.calls.append("kill")
        self._set_state(VMState.DEAD)


def test_prewarm_restores_runs_one_command_then_stops() -> None:
    vm = _StubVM()
    asyncio.run(prewarm(vm))
    assert vm.calls == ["restore", "exec " + " ".join(WARM_EXEC), "stop"]
    assert vm.state == "warm"


def test_an_image_without_the_warm_up_command_is_only_less_warm() -> None:
    vm = _StubVM(exit_code=127)  # no `true` on its PATH
    asyncio.run(prewarm(vm))
    assert vm.calls == ["restore", "exec " + " ".join(WARM_EXEC), "stop"]
    assert vm.state == "warm"


def test_a_warm_up_that_fails_kills_it_and_it_is_never_handed_out() -> None:
    vm = _StubVM(exec_fails=True)  # the agent does not answer
    with pytest.raises(VMError, match="agent gone"):
        asyncio.run(prewarm(vm))
    assert vm.calls[-1] == "kill" and "stop" not in vm.calls
    assert vm.state == "dead"
