"""Warm forks: a pooled QEMU restored and run once ahead of time, then stopped.

Under TCG most of a fork's latency is translating the guest code its first
request runs (the agent's ``restore`` path, its socket loop) in a QEMU that
has translated nothing yet. A pooled VM (:class:`forkd.vmm.pool.ForkPool`)
therefore does the whole restore in the background, under the sandbox id it
will have, and stops its vCPUs (:func:`prewarm`). Handing it out
(:func:`claim`) is ``cont`` and one more ``restore``: the clock set
to now and the RNGs reseeded again, on code already translated.

What a pooled child has executed before it is handed out: from the
snapshot's instant, the agent's ``restore`` (clock, kernel RNG and Python
``random`` reseeded with fresh entropy, hostname set to its own id), then one
``exec`` of ``true`` (so the agent's exec path, the guest kernel's fork, exec
and exit and the dynamic loader are translated: a claimed child's first
command costs about a third of what it costs a fresh one), plus whatever else
the guest did in those milliseconds of guest time (its processes ran on for as
long). Its clock is set again at the claim. Output its processes wrote
meanwhile is in its output rings like any other.

While it warms up, the QEMU runs at a lower CPU priority (when the daemon
may raise it again), so filling the pool never starves running sandboxes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Protocol

from forkd import agent_wire as wire
from forkd import limits
from forkd.errors import ForkdError, VMError
from forkd.states import VMState

log = logging.getLogger(__name__)

POOL_NICE = 10  # while a pooled QEMU restores; back to 0 when it is claimed
WARM_EXEC = ["true"]  # run once by a pooled VM before it stops


def renice(pid: int, nice: int) -> None:
    """Set the CPU priority of every thread of process ``pid`` (QEMU's vCPU threads
    too); does nothing when the daemon could not set it back (not root)."""
    if os.geteuid() != 0:
        return
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


class QemuControl(Protocol):
    async def execute(self, cmd: str) -> object: ...


class WarmableGuest(Protocol):
    """What warming and handing out a pooled VM use of its guest
    (:class:`forkd.vmm.agent.ops.Guest`)."""

    seed: int | None

    async def exec(self, argv: list[str], *, timeout: float = ...) -> wire.ExecAnswer: ...
    async def make_unique(
        self, hostname: str, wait: float, *, seed: int | None = ...
    ) -> wire.RestoreAnswer: ...


class Warmable(Protocol):
    """What warming and handing out a pooled VM use of it (:class:`forkd.vmm.vm.VM`)."""

    id: str
    pid: int
    ready_ms: float | None

    @property
    def state(self) -> VMState: ...
    @property
    def qmp(self) -> QemuControl: ...

    def _set_state(self, new: VMState) -> None: ...
    async def finish_restore(self, *, hostname: str | None = ..., timeout: float = ...) -> None: ...
    @property
    def guest(self) -> WarmableGuest: ...

    async def kill(self) -> None: ...


async def prewarm(vm: Warmable, timeout: float = limits.RESTORE_TIMEOUT_SECS) -> None:
    """Restore ``vm`` from :meth:`VM.spawn_incoming` under its own id, then stop its
    vCPUs: state ``warm``, ready for :func:`claim`."""
    renice(vm.pid, POOL_NICE)
    await vm.finish_restore(hostname=vm.id, timeout=timeout)
    try:
        warm = await vm.guest.exec(WARM_EXEC, timeout=timeout)
        if warm.get("exit_code") != 0:  # an image without `true`: only less warm
            log.info("warming the exec path of %s: %s", vm.id, warm)
        await vm.qmp.execute("stop")
    except BaseException:
        await vm.kill()
        raise
    vm._set_state(VMState.WARM)


async def claim(
    vm: Warmable, timeout: float = limits.RESTORE_TIMEOUT_SECS, *, seed: int | None = None
) -> None:
    """Hand out a warm VM: its vCPUs run again and its clock and RNGs are set anew
    (Python's random from ``seed`` when given). ``ready_ms`` is the claim's own
    latency. On failure the VM is killed."""
    if vm.state != VMState.WARM:
        raise VMError(f"{vm.id} is not a warm pooled VM (it is {vm.state})")
    started = time.monotonic()
    try:
        renice(vm.pid, 0)
        await vm.qmp.execute("cont")
        vm._set_state(VMState.RUNNING)
        result = await vm.guest.make_unique(vm.id, timeout, seed=seed)
        vm.guest.seed = seed
    except BaseException as exc:
        await vm.kill()
        if isinstance(exc, ForkdError) and not isinstance(exc, VMError):
            raise VMError(f"claiming pooled VM {vm.id} failed: {exc}") from exc
        raise
    if result.get("rng_reseeded") is not True or result.get("random_reseeded") is not True:
        await vm.kill()
        raise VMError(f"pooled VM {vm.id} could not reseed its RNGs: {result}")
    vm.ready_ms = (time.monotonic() - started) * 1000
