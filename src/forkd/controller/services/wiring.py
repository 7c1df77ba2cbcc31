"""How the services are built: :class:`Wiring` makes each one once, the first time it
is asked for, handing it exactly what its constructor names. The order follows from
what each needs; a cycle could not be built at all (it would ask for itself).
Nothing is assigned to a service after it is made but the audit log, which the app
opens at start.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

from forkd.controller.metrics import Metrics
from forkd.controller.secret_box import SecretBox
from forkd.controller.services.activity import Activity
from forkd.controller.services.admission import AdmissionControl
from forkd.controller.services.branches import BranchService
from forkd.controller.services.capacity import Capacity
from forkd.controller.services.diffs import DiffService
from forkd.controller.services.egress_audit import EgressReport
from forkd.controller.services.events import EventBus
from forkd.controller.services.expiry import Expiry
from forkd.controller.services.explore import ExploreService
from forkd.controller.services.file_transfer import FileTransferService
from forkd.controller.services.guest_calls import GuestCalls
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.hibernation import HibernateService, WakeService
from forkd.controller.services.holds import Holds
from forkd.controller.services.host_memory import MemoryWatch
from forkd.controller.services.images import ImageService, Importer
from forkd.controller.services.launcher import Launcher, VMDriver, cgroup_hierarchy, qemu_driver
from forkd.controller.services.lifecycle import Lifecycle
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.network import NetworkService
from forkd.controller.services.pausing import PauseService
from forkd.controller.services.ports import PortService
from forkd.controller.services.processes import ProcessService
from forkd.controller.services.reclaim import Reclaimer
from forkd.controller.services.records import Records
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
from forkd.controller.services.workspaces import WorkspaceService
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.webhooks.service import WebhookService
from forkd.egress.ca import EgressCA
from forkd.egress.intercept import Interceptor
from forkd.egress.proxy import EgressProxy
from forkd.egress.records import EgressLog
from forkd.egress.resolver import PinnedHosts, Resolver
from forkd.vmm.jail.network import HostNetwork
from forkd.vmm.pool import ForkPool


@dataclass
class Egress:
    """The egress proxy every sandbox's connections go through, the CA it intercepts
    with, and its report of refusals (to the audit log)."""

    proxy: EgressProxy
    ca: EgressCA
    report: EgressReport


class Wiring:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        driver: VMDriver | None = None,
        importer: Importer | None = None,
    ) -> None:
        self.settings, self.store, self.metrics = settings, store, metrics
        self._driver, self._importer = driver, importer
        settings.snapshot_root.mkdir(parents=True, exist_ok=True)
        settings.run_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ shared pieces

    @cached_property
    def events(self) -> EventBus:
        bus = EventBus()  # lifecycle events: every service publishes here
        bus.guard(self.store.lock)  # an event in a transaction: its outbox rows in it
        return bus

    @cached_property
    def holds(self) -> Holds:
        return Holds()

    @cached_property
    def activity(self) -> Activity:
        return Activity()

    @cached_property
    def hibernated(self) -> HibernatedFiles:
        return HibernatedFiles(self.settings.snapshot_root)

    @cached_property
    def records(self) -> Records:
        return Records(self.store, self.settings.snapshot_root, self.holds, self.activity)

    @cached_property
    def host_network(self) -> HostNetwork:
        s = self.settings
        return HostNetwork(s.sandbox_cidr, s.network, s.egress_host_networks)

    @cached_property
    def egress(self) -> Egress:
        """The egress proxy, put in the sandboxes' way unless ``--egress-proxy`` is off."""
        s = self.settings
        ca = EgressCA(s.state_dir)  # made at the first interception
        report = EgressReport(self.events)
        proxy = EgressProxy(
            Resolver(PinnedHosts(s.egress_hosts)),
            s.sandbox_cidr,
            EgressLog(report),
            Interceptor(ca, self.secrets, s.egress_ca_file),
            dns_upstream=self.host_network.resolver,
            rate=s.egress_rate,
        )
        if s.egress_proxy:
            self.host_network.use_egress(proxy)
        return Egress(proxy, ca, report)

    @cached_property
    def launcher(self) -> Launcher:
        driver = self._driver or qemu_driver()
        return Launcher(driver, self.host_network, cgroup_hierarchy(self.settings))

    @cached_property
    def pool(self) -> ForkPool[SandboxVM]:
        """QEMU processes restored ahead from the snapshots forked most, for forks."""
        s, launcher = self.settings, self.launcher
        return ForkPool(
            s.run_dir,
            per_snapshot=s.pool_size,
            detach=True,  # a pooled QEMU becomes a sandbox that outlives the daemon
            new_id=self.store.next_sandbox_id,
            spawn=functools.partial(
                launcher.driver.spawn_incoming,
                host_network=launcher.network,
                cgroup=launcher.placement(),
            ),
            warm=True,  # restored ahead and stopped: a fork is cont + one agent call
            memory_cap_mib=s.pool_memory_mib,
        )

    @cached_property
    def vms(self) -> LiveVMs:
        return LiveVMs(
            self.store,
            self.records,
            self.events,
            self.holds,
            self.activity,
            self.hibernated,
            self.pool,
            self.stop_hooks,
        )

    @cached_property
    def stop_hooks(self) -> StopHooks:
        return StopHooks(self.store, self.events)

    @cached_property
    def memory(self) -> MemoryWatch:
        s, vms = self.settings, self.vms
        return MemoryWatch(lambda: vms, cgroup_root=s.cgroup_root, cgroup_parent=s.cgroup_parent)

    # ------------------------------------------------------------ under the others

    @cached_property
    def box(self) -> SecretBox:
        return SecretBox(self.settings.state_dir, self.settings.secrets_key_file)

    @cached_property
    def secrets(self) -> SecretService:
        return SecretService(self.store, self.box)

    @cached_property
    def webhooks(self) -> WebhookService:
        return WebhookService(self.store, self.box, self.events, self.settings.webhook_allow)

    @cached_property
    def hibernation(self) -> HibernateService:
        return HibernateService(
            self.settings,
            self.store,
            self.activity,
            self.hibernated,
            self.records,
            self.vms,
            self.events,
        )

    @cached_property
    def reclaim(self) -> Reclaimer:
        return Reclaimer(
            self.settings,
            self.store,
            self.events,
            self.holds,
            self.activity,
            self.memory,
            self.vms,
            self.hibernation,
            self.metrics.observe_eviction,
        )

    @cached_property
    def admission(self) -> AdmissionControl:
        return AdmissionControl(self.settings, self.vms.memory_mib, self.reclaim, self.memory)

    @cached_property
    def pausing(self) -> PauseService:
        waking = WakeService(
            self.settings,
            self.store,
            self.holds,
            self.hibernated,
            self.records,
            self.vms,
            self.launcher,
            self.admission,
            self.events,
            self.shared_volumes,
        )
        return PauseService(
            self.store,
            self.events,
            self.holds,
            self.activity,
            self.records,
            self.vms,
            self.hibernation,
            waking,
        )

    @cached_property
    def waker(self) -> Waker:
        resume = self.pausing.resume_for_request
        return Waker(self.holds, self.records, self.vms, resume, self.metrics.observe_wake)

    @cached_property
    def guest(self) -> GuestCalls:
        return GuestCalls(self.vms, self.waker)

    # ------------------------------------------------------------ what users call

    @cached_property
    def volumes(self) -> VolumeService:
        return VolumeService(self.settings, self.store, self.vms, self.pool, self.holds)

    @cached_property
    def images(self) -> ImageService:
        return ImageService(self.settings, self._importer)

    @cached_property
    def snapshots(self) -> SnapshotService:
        return SnapshotService(
            self.settings,
            self.store,
            self.metrics,
            self.events,
            self.holds,
            self.records,
            self.pool,
            self.launcher,
            self.egress.ca,
            self.admission,
            self.volumes,
            self.images,
            self.stop_hooks,
        )

    @cached_property
    def capacity(self) -> Capacity:
        return Capacity(self.settings, self.store, self.admission, self.memory)

    @cached_property
    def transfer(self) -> SnapshotTransfer:
        return SnapshotTransfer(
            self.settings, self.store, self.metrics, self.events, self.records, self.snapshots
        )

    @cached_property
    def shared_volumes(self) -> SharedVolumes:
        """E2B's volumes: directories sandboxes share (mounted on the host by start())."""
        s = self.settings
        root = s.state_dir / "shared-volumes"
        return SharedVolumes(self.store, root, s.shared_volume_mib << 20, s.disk_reserve_mib)

    @cached_property
    def sandboxes(self) -> SandboxService:
        return SandboxService(
            self.settings,
            self.store,
            self.metrics,
            self.events,
            self.holds,
            self.activity,
            self.records,
            self.vms,
            self.pool,
            self.launcher,
            self.admission,
            self.waker,
            self.snapshots,
            self.shared_volumes,
        )

    @cached_property
    def branches(self) -> BranchService:
        return BranchService(
            self.settings,
            self.store,
            self.metrics,
            self.events,
            self.holds,
            self.hibernated,
            self.records,
            self.vms,
            self.snapshots,
            self.shared_volumes,
        )

    @cached_property
    def expiry(self) -> Expiry:
        return Expiry(self.store, self.events, self.activity, self.vms, self.pausing, self.branches)

    @cached_property
    def network(self) -> NetworkService:
        return NetworkService(
            self.events,
            self.hibernated,
            self.records,
            self.vms,
            self.launcher,
            self.egress.proxy,
        )

    @cached_property
    def explore(self) -> ExploreService:
        return ExploreService(
            self.store,
            self.events,
            self.records,
            self.vms,
            self.admission,
            self.branches,
            self.sandboxes,
            self.guest,
            self.snapshots,
            self.network,
        )

    @cached_property
    def processes(self) -> ProcessService:
        return ProcessService(self.store, self.activity, self.guest)

    @cached_property
    def ports(self) -> PortService:
        return PortService(self.settings, self.store, self.records, self.vms, self.waker)

    @cached_property
    def files(self) -> FileTransferService:
        return FileTransferService(self.guest)

    @cached_property
    def diffs(self) -> DiffService:
        return DiffService(
            self.store,
            self.records,
            self.vms,
            self.waker,
            self.sandboxes,
            self.guest,
            self.files,
        )

    @cached_property
    def lifecycle(self) -> Lifecycle:
        return Lifecycle(
            self.settings,
            self.store,
            self.activity,
            self.hibernated,
            self.vms,
            self.pool,
            self.launcher,
            self.expiry.expire,
        )

    @cached_property
    def usage(self) -> UsageService:
        return UsageService(self.store, self.activity, self.vms)

    @cached_property
    def workspaces(self) -> WorkspaceService:
        return WorkspaceService(self.store, self.sandboxes, self.pausing)
