"""Calls into a sandbox's guest for a request: its VM found (a paused or hibernated
one woken first, unless the call says not to), the agent's failures turned into
forkd's errors (the guest's exception says whose fault it was), and what the API asks
of a guest directly: ping, exec, eval, and single files."""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from forkd import limits
from forkd.controller.models import (
    DisplayOutput,
    EvalInterrupt,
    EvalRequest,
    EvalResult,
    ExecRequest,
    ExecResult,
    FileEntry,
    PingResult,
)
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.waking import Waker
from forkd.errors import (
    AgentError,
    Conflict,
    Forbidden,
    ForkdError,
    Invalid,
    NotFound,
    OverCapacity,
)
from forkd.vmm.agent.ops import EVAL_IMAGE_REFUSALS

T = TypeVar("T")

# The guest's exception, when the agent answered with one, says whose fault it was.
_GUEST_REFUSALS: dict[str, type[ForkdError]] = {
    "FileNotFoundError": NotFound,
    "IsADirectoryError": Invalid,
    "NotADirectoryError": Invalid,
    "FileExistsError": Conflict,
    "ValueError": Invalid,
    "PermissionError": Forbidden,
    # Background processes (the proc_* ops): no such pid, exited, too many running.
    "ProcessLookupError": NotFound,
    "BrokenPipeError": Conflict,
    "BlockingIOError": OverCapacity,
    # Any other refusal of the guest's filesystem (busy, read-only, full): its state.
    "OSError": Conflict,
}


# Eval in a container image without a usable python3: a 409, like any request the
# sandbox's state (here its image) cannot serve; the same body succeeds elsewhere.
EVAL_REFUSALS: dict[str, type[ForkdError]] = dict.fromkeys(EVAL_IMAGE_REFUSALS, Conflict)

EXIT_WAIT_SECS = 1.0  # for a QEMU whose agent channel just closed to finish exiting


async def _exited(vm: SandboxVM, wait: float) -> bool:
    """Whether ``vm``'s QEMU has exited, polling for ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while vm.is_alive():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


class GuestCalls:
    def __init__(self, vms: LiveVMs, waker: Waker) -> None:
        self.vms = vms
        self.waker = waker

    async def call(
        self,
        sandbox_id: str,
        call: Callable[[SandboxVM], Awaitable[T]],
        refusals: Mapping[str, type[ForkdError]] | None = None,
        wake: bool = True,
    ) -> T:
        """``call(vm)`` on the sandbox's running VM, with agent failures classified.

        ``refusals`` overrides entries of the table from the guest's exception
        names to forkd errors, for a call where one name means something else.
        ``wake``: a paused or hibernated sandbox is resumed first (:mod:`.waking`);
        without it, such a sandbox is a 409.
        """
        vm = await self.waker.running(sandbox_id) if wake else self.vms.live(sandbox_id)
        try:
            return await call(vm)
        except AgentError as exc:
            # No answer at all (kind None): QEMU may be exiting (killed at its
            # memory cap, say) and its channel closed first. Give it a moment.
            if await _exited(vm, EXIT_WAIT_SECS if exc.kind is None else 0):
                if self.vms.get(sandbox_id) is not vm:
                    # Hibernated, killed or replaced while the call waited: its QEMU
                    # was ended on purpose, and the sandbox is whatever that made it.
                    raise Conflict(
                        f"sandbox {sandbox_id!r} was stopped or hibernated during the call"
                    ) from exc
                await self.vms.mark_dead(sandbox_id)
                raise Conflict(f"sandbox {sandbox_id!r} died: {exc}") from exc
            refusal = {**_GUEST_REFUSALS, **(refusals or {})}.get(exc.kind or "")
            if refusal is not None:
                raise refusal(str(exc)) from exc
            raise

    async def ping(self, sandbox_id: str) -> PingResult:
        res = await self.call(sandbox_id, lambda vm: vm.guest.ping())
        return PingResult.model_validate({**res, "pong": True})

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        res = await self.call(
            sandbox_id,
            lambda vm: vm.guest.exec(
                req.args,
                timeout=req.timeout_secs,
                cwd=req.cwd,
                env=req.env or None,
                stdin=req.stdin,
                user=req.user,
            ),
        )
        return ExecResult(
            stdout=res.get("stdout", ""),
            stderr=res.get("stderr", ""),
            exit_code=res.get("exit_code"),
            timed_out=res.get("timed_out", False),
            stdout_truncated=res.get("stdout_truncated", False),
            stderr_truncated=res.get("stderr_truncated", False),
            duration_ms=res.get("duration_ms"),
        )

    async def eval(
        self,
        sandbox_id: str,
        req: EvalRequest,
        tag: str | None = None,
        context: str | None = None,
    ) -> EvalResult:
        """``req`` in the sandbox's warm interpreter, or in the eval context ``context``
        (one :meth:`open_context` made: 404 for none)."""
        res = await self.call(
            sandbox_id,
            lambda vm: vm.guest.eval(req.code, timeout=req.timeout_s, tag=tag, context=context),
            refusals={**EVAL_REFUSALS, **CONTEXT_REFUSALS},
        )
        error = res.get("error")
        return EvalResult(
            result=res.get("result"),
            error=error_summary(error) if error else error,
            traceback=error or None,
            exit_code=res.get("exit_code", 0),
            stdout=res.get("stdout", ""),
            stderr=res.get("stderr", ""),
            display=[DisplayOutput(**item) for item in res.get("display", [])],
            display_truncated=res.get("display_truncated", False),
            timed_out=res.get("timed_out", False),
        )

    async def eval_interrupt(self, sandbox_id: str, context: str | None = None) -> EvalInterrupt:
        # Without a context the op takes no parameter: a refusal means an older agent.
        interrupted = await self.call(
            sandbox_id,
            lambda vm: vm.guest.eval_interrupt(context),
            refusals={"ValueError": Conflict, **CONTEXT_REFUSALS},
        )
        return EvalInterrupt(interrupted=interrupted)

    async def open_context(
        self, sandbox_id: str, context: str, language: str, cwd: str | None = None
    ) -> bool:
        """An eval context of its own in the sandbox (a worker process, ``python`` or
        ``javascript``); False when one of that id is open."""
        return await self.call(
            sandbox_id, lambda vm: vm.guest.eval_context_open(context, language, cwd)
        )

    async def close_context(self, sandbox_id: str, context: str) -> bool:
        return await self.call(sandbox_id, lambda vm: vm.guest.eval_context_close(context))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        path = limits.check_guest_path(path)
        return await self.call(sandbox_id, lambda vm: vm.guest.read_file(path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> int:
        path = limits.check_guest_path(path)
        return await self.call(sandbox_id, lambda vm: vm.guest.write_file(path, data))

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        path = limits.check_guest_path(path)
        entries = await self.call(sandbox_id, lambda vm: vm.guest.list_dir(path))
        return [FileEntry(**entry) for entry in entries]

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool) -> None:
        path = limits.check_guest_path(path)
        await self.call(sandbox_id, lambda vm: vm.guest.remove(path, recursive))


# An eval context the guest does not have (a fork's, a restarted daemon's record).
CONTEXT_REFUSALS: dict[str, type[ForkdError]] = {"NoContext": NotFound}


def error_summary(text: str) -> str:
    """A traceback's last line (``NameError: name 'x' is not defined``): the summary the
    original forkd's eval answered as ``error``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text
