"""The daemon's domain services: snapshots, images, branches, sandboxes, explore, pausing,
processes, files, diffs, volumes, lifecycle.

Each takes and returns typed objects (:mod:`forkd.controller.models`) and
raises only errors of :mod:`forkd.errors`; none knows about HTTP.
:class:`Services` wires them to one shared :class:`~.fleet.Fleet`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from forkd.controller.metrics import Metrics
from forkd.controller.secret_box import SecretBox
from forkd.controller.services.branches import BranchService
from forkd.controller.services.diffs import DiffService
from forkd.controller.services.expiry import Expiry
from forkd.controller.services.explore import ExploreService
from forkd.controller.services.file_transfer import FileTransferService
from forkd.controller.services.fleet import Fleet, VMDriver
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
from forkd.egress.ca import EgressCA
from forkd.egress.intercept import Interceptor
from forkd.egress.records import EgressRecord

__all__ = ["Services"]


def _egress_event(fleet: Fleet, network: NetworkService, record: EgressRecord) -> None:
    """Each connection (and HTTP request) the proxy let out or refused, as an event; a
    refusal also in the audit log."""
    network.refusals.note(record)
    fields = record.to_json()
    fields["record_id"], fields["began_at"] = fields.pop("id"), fields.pop("time")
    fleet.events.publish("egress", **fields)


@dataclass
class Services:
    fleet: Fleet
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
        fleet = Fleet(settings, store, metrics, driver)
        volumes = VolumeService(fleet)
        image_service = ImageService(fleet, importer)
        snapshots = SnapshotService(fleet, volumes, image_service)
        sandboxes = SandboxService(fleet, snapshots)
        branches = BranchService(fleet, snapshots)
        pausing = PauseService(fleet, sandboxes)
        fleet.waker = Waker(pausing.resume_for_request, metrics.observe_wake)
        reclaim = Reclaimer(fleet, pausing, metrics.observe_eviction)
        fleet.make_room = reclaim.make_room
        fleet.admission.reclaim_hint = reclaim.busy_summary
        expiry = Expiry(fleet, pausing, branches)
        files = FileTransferService(sandboxes)
        secrets = SecretService(store, SecretBox(settings.state_dir, settings.secrets_key_file))
        fleet.egress_ca = EgressCA(settings.state_dir)
        fleet.egress.interception = Interceptor(fleet.egress_ca, secrets, settings.egress_ca_file)
        network = NetworkService(fleet)
        fleet.egress.log.notify = functools.partial(_egress_event, fleet, network)
        explore = ExploreService(fleet, branches, sandboxes, snapshots)
        explore.set_network = network.update
        secrets.users = network.rules_naming
        return cls(
            fleet=fleet,
            snapshots=snapshots,
            images=image_service,
            transfer=SnapshotTransfer(fleet, snapshots),
            branches=branches,
            sandboxes=sandboxes,
            explore=explore,
            pausing=pausing,
            processes=ProcessService(sandboxes),
            ports=PortService(fleet),
            files=files,
            diffs=DiffService(fleet, sandboxes, files),
            volumes=volumes,
            expiry=expiry,
            lifecycle=Lifecycle(fleet, expiry.expire),
            reclaim=reclaim,
            usage=UsageService(fleet),
            workspaces=WorkspaceService(fleet, sandboxes, pausing),
            secrets=secrets,
            network=network,
        )
