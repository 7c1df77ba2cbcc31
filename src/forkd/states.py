"""The states things move through, each with the one table of its legal moves.

A state is a :class:`~enum.StrEnum`: its value is the word the API, the database
and the logs have always used, so the wire does not change. A move not in its
table raises :class:`IllegalTransition` where it is made (``Store.set_sandbox_state``,
``Store.set_snapshot_status``, ``VM._set_state``), so a race or a bug stops there
instead of leaving a dead sandbox marked running.

This module imports nothing of forkd's but its errors: the VM layer, the daemon
and the SDK's documentation may all read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

from forkd.errors import Conflict


class SandboxState(StrEnum):
    """A sandbox's life, as ``GET /v1/sandboxes/{id}`` shows it."""

    STARTING = "starting"  # a row before its VM answers
    RUNNING = "running"
    PAUSED = "paused"  # vCPUs stopped, memory kept
    HIBERNATED = "hibernated"  # on disk, no QEMU
    DEAD = "dead"  # its QEMU ended; the row stays until deleted


SANDBOX_MOVES: Mapping[SandboxState, frozenset[SandboxState]] = {
    SandboxState.STARTING: frozenset({SandboxState.RUNNING, SandboxState.DEAD}),
    SandboxState.RUNNING: frozenset(
        {SandboxState.PAUSED, SandboxState.HIBERNATED, SandboxState.DEAD}
    ),
    SandboxState.PAUSED: frozenset(
        {SandboxState.RUNNING, SandboxState.HIBERNATED, SandboxState.DEAD}
    ),
    # Woken: its QEMU runs again (a failed wake leaves it hibernated).
    SandboxState.HIBERNATED: frozenset({SandboxState.RUNNING, SandboxState.DEAD}),
    SandboxState.DEAD: frozenset(),
}


class VMState(StrEnum):
    """A QEMU process as :class:`~forkd.vmm.vm.VM` drives it."""

    STARTING = "starting"  # launched, not yet answering
    INCOMING = "incoming"  # a fork's QEMU waiting for the snapshot's state
    WARM = "warm"  # restored ahead of time for the pool, vCPUs stopped
    RUNNING = "running"
    PAUSED = "paused"
    DEAD = "dead"


VM_MOVES: Mapping[VMState, frozenset[VMState]] = {
    # Booted, waiting for a fork's state, or adopted as a restarted daemon found it.
    VMState.STARTING: frozenset({VMState.RUNNING, VMState.INCOMING, VMState.PAUSED, VMState.DEAD}),
    VMState.INCOMING: frozenset({VMState.RUNNING, VMState.DEAD}),
    VMState.RUNNING: frozenset({VMState.PAUSED, VMState.WARM, VMState.DEAD}),
    VMState.WARM: frozenset({VMState.RUNNING, VMState.DEAD}),
    VMState.PAUSED: frozenset({VMState.RUNNING, VMState.DEAD}),
    VMState.DEAD: frozenset(),
}


class SnapshotStatus(StrEnum):
    """A snapshot's record. (``broken`` is never stored: an answer says it when a
    file is missing or corrupt.)"""

    WRITING = "writing"  # a branch with wait false, being written (the original's name)
    READY = "ready"
    FAILED = "failed"  # that branch failed: see its error


SNAPSHOT_MOVES: Mapping[SnapshotStatus, frozenset[SnapshotStatus]] = {
    SnapshotStatus.WRITING: frozenset({SnapshotStatus.READY, SnapshotStatus.FAILED}),
    SnapshotStatus.READY: frozenset(),
    SnapshotStatus.FAILED: frozenset(),
}


class SnapshotMode(StrEnum):
    """How a snapshot's memory is stored."""

    FULL = "full"
    DIFF = "diff"  # the pages that differ from its base_tag's


class BranchMode(StrEnum):
    """What a branch request asks for (``live`` is taken as full and recorded so)."""

    FULL = "full"
    DIFF = "diff"
    LIVE = "live"


class OnTimeout(StrEnum):
    """What a sandbox's timeout (or idle timeout) does to it."""

    KILL = "kill"
    PAUSE = "pause"
    BRANCH = "branch"
    HIBERNATE = "hibernate"


class IllegalTransition(Conflict):
    """A move its table does not allow: another request changed the thing first."""


S = TypeVar("S", bound=StrEnum)


def check_move(what: str, moves: Mapping[S, frozenset[S]], old: S, new: S) -> None:
    """Raise :class:`IllegalTransition` unless ``old`` → ``new`` is in ``moves``. Staying
    where it is is no move (a second kill, a resume of a running VM)."""
    if new != old and new not in moves[old]:
        raise IllegalTransition(f"{what} is {old.value}: it cannot become {new.value}")
