"""What this daemon can take: its caps and what is in use, the host's memory, the
snapshots it can fork (``GET /v1/capacity``: a gateway places forks by it)."""

from __future__ import annotations

from forkd import __version__, accel
from forkd.controller.models import CapacityInfo
from forkd.controller.services.admission import AdmissionControl
from forkd.controller.services.host_memory import MemoryWatch
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.oci import host_needs
from forkd.states import SnapshotStatus


class Capacity:
    def __init__(
        self, settings: Settings, store: Store, admission: AdmissionControl, memory: MemoryWatch
    ) -> None:
        self.settings = settings
        self.store = store
        self.admission = admission
        self.memory = memory

    def info(self) -> CapacityInfo:
        """What this node holds and may hold: sandboxes, guest memory, host memory, the
        snapshots it can fork."""
        count, mib = self.admission.in_use()
        try:
            host = self.memory.host()
        except (OSError, KeyError, ValueError):  # no /proc/meminfo: not Linux, a jail
            host = None
        self.memory.sample()
        return CapacityInfo(
            node_id=self.store.id_prefix,
            version=__version__,
            accel=accel.choose(self.settings.accel).name,
            qemu=host_needs.qemu_release(),
            sandboxes=count,
            max_sandboxes=self.settings.max_sandboxes,
            guest_memory_mib=mib,
            max_guest_memory_mib=self.settings.max_guest_memory_mib,
            memory_overcommit=self.settings.memory_overcommit,
            host_memory_mib=None if host is None else host.total_mib,
            host_memory_available_mib=None if host is None else host.available_mib,
            memory_reserve_mib=self.settings.memory_reserve_mib,
            sandboxes_own_memory_mib=self.memory.sandboxes_mib(),
            snapshots=[
                r.tag for r in self.store.list_snapshots() if r.status == SnapshotStatus.READY
            ],
        )
