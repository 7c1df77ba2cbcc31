"""A VM's state, changed by the VM's own methods only and along :data:`~forkd.states.VM_MOVES`."""

from __future__ import annotations

from forkd.states import VM_MOVES, VMState, check_move


class VMLifecycle:
    """Mixed into :class:`~forkd.vmm.vm.VM` and its parts: ``state`` to read,
    ``_set_state`` to move it (an illegal move raises
    :class:`~forkd.states.IllegalTransition`)."""

    id: str
    _state: VMState = VMState.STARTING

    @property
    def state(self) -> VMState:
        return self._state

    def _set_state(self, new: VMState) -> None:
        check_move(f"VM {self.id}", VM_MOVES, self._state, new)
        self._state = new
