"""What the E2B port keeps of each sandbox in the daemon's memory (a command's tags, the
code interpreter's contexts), bounded: once it holds more than :data:`MAX_HELD`
sandboxes, those no longer in the store are dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from forkd.controller.services import Services
from forkd.states import SandboxState

V = TypeVar("V")
MAX_HELD = 1024


def still_there(svc: Services, sandbox_id: str) -> bool:
    """Whether the sandbox is still there to keep anything for (not unknown, not dead)."""
    row = svc.store.get_sandbox(sandbox_id)
    return row is not None and row.state != SandboxState.DEAD


class PerSandbox(Generic[V]):
    """``make()`` for each sandbox, kept; ``exists`` says which sandboxes are still there,
    when it is time to forget the others."""

    def __init__(self, make: Callable[[], V], exists: Callable[[str], bool]) -> None:
        self._make = make
        self._exists = exists
        self._held: dict[str, V] = {}

    def of(self, sandbox_id: str) -> V:
        """``sandbox_id``'s value, made when first asked for."""
        found = self._held.get(sandbox_id)
        if found is None:
            if len(self._held) >= MAX_HELD:
                self._held = {k: v for k, v in self._held.items() if self._exists(k)}
                while len(self._held) >= MAX_HELD:  # all still there: the oldest goes
                    del self._held[next(iter(self._held))]
            found = self._held[sandbox_id] = self._make()
        return found

    def get(self, sandbox_id: str) -> V | None:
        return self._held.get(sandbox_id)
