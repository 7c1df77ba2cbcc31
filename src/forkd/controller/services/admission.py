"""Admission: what running and starting sandboxes take, checked against the
daemon's caps before anything starts.

Three limits, each a 429 that names itself and says by how much it would be passed:

- ``--max-sandboxes``: how many sandboxes run or are being started;
- the nominal cap (``--memory-overcommit`` times the host's RAM, or
  ``--max-guest-memory``): the guest RAM they were given, which bounds what they
  would take if every guest filled its memory at once;
- the host's real memory (``--memory-reserve``): what a new sandbox will really
  hold (its fork estimate, :mod:`.host_memory`) must fit in what the host has
  available, less the reserve and less what sandboxes still starting will take.

Before the last is checked, reclaim (:mod:`.reclaim`) is asked to make room:
:meth:`AdmissionControl.make_room_for`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from forkd.controller.services.host_memory import MemoryWatch
from forkd.controller.settings import Settings
from forkd.errors import OverCapacity


@dataclass
class Admission:
    """Room held for VMs one request is starting, until they run or fail."""

    sandboxes: int  # sandboxes it starts, each of sandbox_mib guest RAM
    sandbox_mib: int
    template_mib: int = 0  # a template build's guest RAM
    estimate_mib: int = 0  # what each of its sandboxes will really hold (host memory)
    ids: set[str] = field(default_factory=set)  # its sandboxes' ids, once known


class Reclaim(Protocol):
    """What admission asks of reclaim (:class:`~.reclaim.Reclaimer`)."""

    async def make_room(self, mib: int) -> list[str]: ...
    def busy_summary(self) -> str: ...


class AdmissionControl:
    """``running()``: the guest MiB of each sandbox's running VM, by sandbox id;
    ``reclaim``: hibernates idle sandboxes to make room, and says why it could not."""

    def __init__(
        self,
        settings: Settings,
        running: Callable[[], Mapping[str, int]],
        reclaim: Reclaim,
        memory: MemoryWatch | None = None,
    ) -> None:
        self._settings = settings
        self._running = running
        self._memory = memory  # None: no check against the host's real memory
        self._admitted: list[Admission] = []  # requests starting VMs right now
        self._reclaim = reclaim

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

    def starting_mib(self) -> int:
        """Host memory the requests holding room will take for what they start."""
        running = self._running()
        return sum(
            (held.sandboxes - len(held.ids & running.keys())) * held.estimate_mib
            + held.template_mib
            for held in self._admitted
        )

    @contextlib.contextmanager
    def admit(
        self,
        what: str,
        sandboxes: int,
        sandbox_mib: int = 0,
        template_mib: int = 0,
        origin: Path | None = None,
    ) -> Iterator[Admission]:
        """Hold room for VMs about to start; :class:`OverCapacity` when a cap would be
        passed. ``origin``: the snapshot directory the sandboxes are forked from (their
        fork estimate is its children's); a template build's guest is counted whole.

        Checked and held in one step (no await between): two requests racing
        for the last slots cannot both get them. The room is given back when
        the block ends; by then the sandboxes are running or gone.
        """
        self.check_caps(what, sandboxes, sandbox_mib, template_mib)
        estimate = 0
        if self._memory is not None and self._settings.memory_reserve_mib is not None:
            estimate = self._check_host(what, sandboxes, template_mib, origin)
        held = Admission(sandboxes, sandbox_mib, template_mib, estimate)
        self._admitted.append(held)
        try:
            yield held
        finally:
            self._admitted.remove(held)

    def check_caps(
        self, what: str, sandboxes: int, sandbox_mib: int = 0, template_mib: int = 0
    ) -> None:
        """:class:`OverCapacity` when these would pass --max-sandboxes or the guest-memory
        cap: what no reclaim can change, so it is said before any sandbox is hibernated
        to make room."""
        count, mib = self.in_use()
        cap = self._settings.max_sandboxes
        if cap is not None and count + sandboxes > cap:
            raise OverCapacity(
                f"{what}: {sandboxes} more sandboxes would make {count + sandboxes}, over this "
                f"daemon's cap of {cap} (--max-sandboxes) by {count + sandboxes - cap}; {count} "
                "are running or starting"
            )
        need = sandboxes * sandbox_mib + template_mib
        mem_cap = self._settings.max_guest_memory_mib
        if mem_cap is not None and mib + need > mem_cap:
            raise OverCapacity(
                f"{what}: {need} MiB more of guest memory would make {mib + need}, over this "
                f"daemon's cap of {mem_cap} MiB ({self._nominal_flag()}) by "
                f"{mib + need - mem_cap}; {mib} MiB are given to sandboxes and template builds "
                "running or starting"
            )

    def _nominal_flag(self) -> str:
        ratio = self._settings.memory_overcommit
        return "--max-guest-memory" if ratio is None else f"--memory-overcommit {ratio:g}"

    async def make_room_for(
        self, sandboxes: int, origin: Path | None = None, template_mib: int = 0
    ) -> None:
        """Before admitting new VMs: when the host's memory would not hold them, have
        reclaim hibernate idle sandboxes for what they lack."""
        short = self.host_shortfall_mib(sandboxes, template_mib, origin)
        if short > 0:
            await self._reclaim.make_room(short)

    def host_shortfall_mib(
        self, sandboxes: int, template_mib: int = 0, origin: Path | None = None
    ) -> int:
        """How much more host memory than is left these would need (0: they fit); what
        reclaim is asked to free before they are admitted."""
        if self._memory is None or self._settings.memory_reserve_mib is None:
            return 0
        _, need, left, _ = self._host_room(sandboxes, template_mib, origin)
        return max(0, need - left)

    def _host_room(
        self, sandboxes: int, template_mib: int, origin: Path | None
    ) -> tuple[int, int, int, int]:
        """(each sandbox's estimate, the MiB they need, the MiB left for them, the MiB
        sandboxes still starting will take)."""
        assert self._memory is not None and self._settings.memory_reserve_mib is not None
        watch = self._memory
        watch.sample()
        estimate = watch.fork_estimate_mib(origin)
        need = sandboxes * estimate + template_mib
        promised = self.starting_mib() + watch.unsettled_mib()
        left = watch.host().available_mib - self._settings.memory_reserve_mib - promised
        return estimate, need, left, promised

    def _check_host(self, what: str, sandboxes: int, template_mib: int, origin: Path | None) -> int:
        """What each sandbox will hold of the host's memory, when all of it fits in what
        the host has left; :class:`OverCapacity` when it does not."""
        assert self._memory is not None and self._settings.memory_reserve_mib is not None
        estimate, need, left, promised = self._host_room(sandboxes, template_mib, origin)
        if need > left:
            available = left + self._settings.memory_reserve_mib + promised
            parts = [f"{sandboxes} x {estimate} MiB a sandbox of it holds"] if sandboxes else []
            parts += [f"{template_mib} MiB of a template's guest"] if template_mib else []
            hint = f"; {self._reclaim.busy_summary()}"
            raise OverCapacity(
                f"{what}: needs about {need} MiB of host memory ({', '.join(parts)}) and "
                f"{max(left, 0)} MiB are left, short by {need - max(left, 0)}: the host has "
                f"{available} MiB available, less {self._settings.memory_reserve_mib} kept in "
                f"reserve (--memory-reserve) and {promised} MiB that sandboxes still starting "
                f"will take{hint}"
            )
        return estimate
