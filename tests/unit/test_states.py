"""The state tables: every state has a row, illegal moves are refused where they are
made, and the words are the wire's."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

import pytest

from forkd.states import (
    SANDBOX_MOVES,
    SNAPSHOT_MOVES,
    VM_MOVES,
    IllegalTransition,
    OnTimeout,
    SandboxState,
    SnapshotMode,
    SnapshotStatus,
    VMState,
    check_move,
)
from forkd.vmm.vm_state import VMLifecycle

OPENAPI = json.loads((Path(__file__).parents[2] / "docs" / "openapi.json").read_text())


@pytest.mark.parametrize(
    ("kind", "moves"),
    [(SandboxState, SANDBOX_MOVES), (SnapshotStatus, SNAPSHOT_MOVES), (VMState, VM_MOVES)],
    ids=["sandbox", "snapshot", "vm"],
)
def test_every_state_has_a_row_and_moves_only_to_states(
    kind: type[StrEnum], moves: dict[StrEnum, frozenset[StrEnum]]
) -> None:
    assert set(moves) == set(kind)
    for targets in moves.values():
        assert targets <= set(kind)


def test_dead_is_final_and_a_sandbox_cannot_start_again() -> None:
    for state in SandboxState:
        if state is not SandboxState.DEAD:
            with pytest.raises(IllegalTransition, match="dead: it cannot become"):
                check_move("sandbox x", SANDBOX_MOVES, SandboxState.DEAD, state)
    with pytest.raises(IllegalTransition):
        check_move("sandbox x", SANDBOX_MOVES, SandboxState.RUNNING, SandboxState.STARTING)
    check_move("sandbox x", SANDBOX_MOVES, SandboxState.DEAD, SandboxState.DEAD)  # no move


def test_a_snapshot_once_ready_or_failed_stays_so() -> None:
    check_move("snapshot t", SNAPSHOT_MOVES, SnapshotStatus.WRITING, SnapshotStatus.READY)
    with pytest.raises(IllegalTransition):
        check_move("snapshot t", SNAPSHOT_MOVES, SnapshotStatus.FAILED, SnapshotStatus.READY)
    with pytest.raises(IllegalTransition):
        check_move("snapshot t", SNAPSHOT_MOVES, SnapshotStatus.READY, SnapshotStatus.WRITING)


class _VM(VMLifecycle):
    id = "vm-1"


def _state(vm: VMLifecycle) -> VMState:
    # Read through a call: an ``assert vm.state is ...`` would narrow ``vm.state`` for mypy
    # past the ``_set_state`` calls that follow.
    return vm.state


def test_a_vm_moves_only_along_its_table() -> None:
    vm = _VM()
    assert _state(vm) is VMState.STARTING
    vm._set_state(VMState.INCOMING)
    with pytest.raises(IllegalTransition, match="VM vm-1 is incoming: it cannot become paused"):
        vm._set_state(VMState.PAUSED)
    assert vm.state is VMState.INCOMING  # a refused move changes nothing
    vm._set_state(VMState.RUNNING)
    vm._set_state(VMState.DEAD)
    with pytest.raises(IllegalTransition):
        vm._set_state(VMState.RUNNING)


def test_the_words_are_the_api_s() -> None:
    schemas = OPENAPI["components"]["schemas"]
    assert schemas["SandboxInfo"]["properties"]["state"]["enum"] == [s.value for s in SandboxState]
    assert schemas["SandboxInfo"]["properties"]["on_timeout"]["enum"] == [
        t.value for t in OnTimeout
    ]
    word: str = "running"  # a str, as a client sends it (not a literal mypy sees never equal)
    assert word == SandboxState.RUNNING and json.dumps(SandboxState.DEAD) == '"dead"'
    snapshot = schemas["SnapshotInfo"]["properties"]
    stored = {status.value for status in SnapshotStatus}
    assert set(snapshot["status"]["enum"]) == stored | {"broken"}  # broken: said, not stored
    assert snapshot["mode"]["enum"] == [m.value for m in SnapshotMode]
