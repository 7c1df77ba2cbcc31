"""The daemon's domain services: snapshots, images, branches, sandboxes, explore, pausing,
processes, files, diffs, volumes, lifecycle.

Each takes and returns typed objects (:mod:`forkd.controller.models`) and
raises only errors of :mod:`forkd.errors`; none knows about HTTP.
:class:`Services` holds them, built once by :class:`~.wiring.Wiring`, each given in
its constructor exactly what it uses: the shared pieces (the store, the registry of
running VMs, the holds, the event bus) and the services it calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from forkd.controller.metrics import Metrics
from forkd.controller.services.activity import Activity
from forkd.controller.services.admission import AdmissionControl
from forkd.controller.services.branches import BranchService
from forkd.controller.services.capacity import Capacity
from forkd.controller.services.diffs import DiffService
from forkd.controller.services.events import EventBus
from forkd.controller.services.expiry import Expiry
from forkd.controller.services.explore import ExploreService
from forkd.controller.services.file_transfer import FileTransferService
from forkd.controller.services.guest_calls import GuestCalls
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.holds import Holds
from forkd.controller.services.images import ImageService, Importer
from forkd.controller.services.launcher import VMDriver
from forkd.controller.services.lifecycle import Lifecycle
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.network import NetworkService
from forkd.controller.services.pausing import PauseService
from forkd.controller.services.ports import PortService
from forkd.controller.services.processes import ProcessService
from forkd.controller.services.reclaim import Reclaimer
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.sandboxes import SandboxService
from forkd.controller.services.secrets import SecretService
from forkd.controller.services.shared_volumes import SharedVolumes
from forkd.controller.services.snapshot_transfer import SnapshotTransfer
from forkd.controller.services.snapshots import SnapshotService
from forkd.controller.services.stop_hooks import StopHooks
from forkd.controller.services.usage import UsageService
from forkd.controller.services.volumes import VolumeService
from forkd.controller.services.waking import Waker
from forkd.controller.services.wiring import Egress, Wiring
from forkd.controller.services.workspaces import WorkspaceService
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.webhooks.service import WebhookService
from forkd.vmm.jail.network import HostNetwork
from forkd.vmm.pool import ForkPool

__all__ = ["Services"]


@dataclass
class Services:
    settings: Settings
    store: Store
    events: EventBus
    activity: Activity
    hibernated: HibernatedFiles
    holds: Holds
    vms: LiveVMs
    pool: ForkPool[SandboxVM]
    host_network: HostNetwork
    egress: Egress
    admission: AdmissionControl
    waker: Waker
    snapshots: SnapshotService
    capacity: Capacity
    images: ImageService
    transfer: SnapshotTransfer
    branches: BranchService
    sandboxes: SandboxService
    guest: GuestCalls
    explore: ExploreService
    pausing: PauseService
    processes: ProcessService
    ports: PortService
    files: FileTransferService
    diffs: DiffService
    volumes: VolumeService
    expiry: Expiry
    lifecycle: Lifecycle
    reclaim: Reclaimer
    usage: UsageService
    workspaces: WorkspaceService
    secrets: SecretService
    network: NetworkService
    webhooks: WebhookService
    stop_hooks: StopHooks
    shared_volumes: SharedVolumes

    @classmethod
    def create(
        cls,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        driver: VMDriver | None = None,
        importer: Importer | None = None,
    ) -> Services:
        """Every service, each built once (:class:`~.wiring.Wiring`)."""
        wiring = Wiring(settings, store, metrics, driver, importer)
        return cls(**{f.name: getattr(wiring, f.name) for f in dataclasses.fields(cls)})
