"""Admission: the sandboxes and guest memory running or being started, checked
against the daemon's caps before anything starts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from forkd.controller.settings import Settings
from forkd.errors import OverCapacity


@dataclass
class Admission:
    """Room held for VMs one request is starting, until they run or fail."""

    sandboxes: int  # sandboxes it starts, each of sandbox_mib guest RAM
    sandbox_mib: int
    template_mib: int = 0  # a template build's guest RAM
    ids: set[str] = field(default_factory=set)  # its sandboxes' ids, once known


class AdmissionControl:
    """``running()``: the guest MiB of each sandbox's running VM, by sandbox id."""

    def __init__(self, settings: Settings, running: Callable[[], Mapping[str, int]]) -> None:
        self._settings = settings
        self._running = running
        self._admitted: list[Admission] = []  # requests starting VMs right now

    def holding(self) -> int:
        """How many requests hold room now."""
        return len(self._admitted)

    def in_use(self) -> tuple[int, int]:
        """Sandboxes and guest MiB running or being started (template builds: MiB only)."""
        running = self._running()
        count, mib = len(running), sum(running.values())
        for held in self._admitted:
            pending = held.sandboxes - len(held.ids & running.keys())  # not running yet
            count += pending
            mib += pending * held.sandbox_mib + held.template_mib
        return count, mib

    @contextlib.contextmanager
    def admit(
        self, what: str, sandboxes: int, sandbox_mib: int = 0, template_mib: int = 0
    ) -> Iterator[Admission]:
        """Hold room for VMs about to start; :class:`OverCapacity` when a cap would be passed.

        Checked and held in one step (no await between): two requests racing
        for the last slots cannot both get them. The room is given back when
        the block ends; by then the sandboxes are running or gone.
        """
        count, mib = self.in_use()
        cap = self._settings.max_sandboxes
        if cap is not None and count + sandboxes > cap:
            raise OverCapacity(
                f"{what}: {sandboxes} more sandboxes would make {count + sandboxes}, over this "
                f"daemon's cap of {cap} (--max-sandboxes); {count} are running or starting"
            )
        need = sandboxes * sandbox_mib + template_mib
        mem_cap = self._settings.max_guest_memory_mib
        if mem_cap is not None and mib + need > mem_cap:
            raise OverCapacity(
                f"{what}: needs {need} MiB of guest memory and {mib} of this daemon's "
                f"{mem_cap} MiB are in use or being started (--max-guest-memory)"
            )
        held = Admission(sandboxes, sandbox_mib, template_mib)
        self._admitted.append(held)
        try:
            yield held
        finally:
            self._admitted.remove(held)
