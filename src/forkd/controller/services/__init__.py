"""The daemon's domain services: snapshots, images, branches, sandboxes, explore, pausing,
processes, files, diffs, volumes, lifecycle.

Each takes and returns typed objects (:mod:`forkd.controller.models`) and
raises only errors of :mod:`forkd.errors`; none knows about HTTP.
:class:`Services` wires them to one shared :class:`~.fleet.Fleet`.
"""

from __future__ import annotations

from dataclasses import dataclass

from forkd.controller.metrics import Metrics
from forkd.controller.secret_box import SecretBox
from forkd.controller.services.admission import AdmissionControl
from forkd.controller.services.branches import BranchService
from forkd.controller.services.diffs import DiffService
from forkd.controller.services.expiry import Expiry
from forkd.controller.services.explore import ExploreService
from forkd.controller.services.file_transfer import FileTransferService
from forkd.controller.services.fleet import Fleet, VMDriver
from forkd.controller.services.hibernation import HibernateService, WakeService
from forkd.controller.services.images import ImageService, Importer
from forkd.controller.services.lifecycle import Lifecycle
from forkd.controller.services.network import NetworkService
from forkd.controller.services.pausing import PauseService
from forkd.controller.services.ports import PortService
from forkd.controller.services.processes import ProcessService
from forkd.controller.services.reclaim import Reclaimer
from forkd.controller.services.sandboxes import SandboxService
from forkd.controller.services.secrets import SecretService
from forkd.controller.services.snapshot_transfer import SnapshotTransfer
from forkd.controller.services.snapshots import SnapshotService
from forkd.controller.services.usage import UsageService
from forkd.controller.services.volumes import VolumeService
from forkd.controller.services.waking import Waker
from forkd.controller.services.workspaces import WorkspaceService
from forkd.controller.settings import Settings
from forkd.controller.store import Store

__all__ = ["Services"]


@dataclass
class Services:
    fleet: Fleet
    admission: AdmissionControl
    waker: Waker
    snapshots: SnapshotService
    images: ImageService
    transfer: SnapshotTransfer
    branches: BranchService
    sandboxes: SandboxService
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

    @classmethod
    def create(
        cls,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        driver: VMDriver | None = None,
        importer: Importer | None = None,
    ) -> Services:
        # Built in the order they need each other, each given what it uses.
        secrets = SecretService(store, SecretBox(settings.state_dir, settings.secrets_key_file))
        fleet = Fleet(settings, store, metrics, secrets, driver)
        hibernation = HibernateService(fleet)
        reclaim = Reclaimer(fleet, hibernation, metrics.observe_eviction)
        admission = AdmissionControl(settings, fleet.vm_memory, reclaim, fleet.memory)
        pausing = PauseService(fleet, hibernation, WakeService(fleet, admission))
        waker = Waker(fleet, pausing.resume_for_request, metrics.observe_wake)
        volumes = VolumeService(fleet)
        image_service = ImageService(fleet, importer)
        snapshots = SnapshotService(fleet, admission, volumes, image_service)
        sandboxes = SandboxService(fleet, admission, waker, snapshots)
        branches = BranchService(fleet, snapshots)
        expiry = Expiry(fleet, pausing, branches)
        files = FileTransferService(sandboxes)
        network = NetworkService(fleet)
        explore = ExploreService(fleet, admission, branches, sandboxes, snapshots, network)
        return cls(
            fleet=fleet,
            admission=admission,
            waker=waker,
            snapshots=snapshots,
            images=image_service,
            transfer=SnapshotTransfer(fleet, snapshots),
            branches=branches,
            sandboxes=sandboxes,
            explore=explore,
            pausing=pausing,
            processes=ProcessService(sandboxes),
            ports=PortService(fleet, waker),
            files=files,
            diffs=DiffService(fleet, waker, sandboxes, files),
            volumes=volumes,
            expiry=expiry,
            lifecycle=Lifecycle(fleet, expiry.expire),
            reclaim=reclaim,
            usage=UsageService(fleet),
            workspaces=WorkspaceService(fleet, sandboxes, pausing),
            secrets=secrets,
            network=network,
        )
