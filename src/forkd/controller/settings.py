"""What one daemon is told at start: its directories, caps and accelerator."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from forkd.controller.connection_limits import ConnectionLimits
from forkd.controller.registry_policy_file import PolicyFile, RegistryChoices
from forkd.limits import (
    DISK_RESERVE_MIB,
    FILE_UPLOAD_LIMIT,
    IMPORT_TIMEOUT_SECS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_ENTRIES,
)

if TYPE_CHECKING:  # the services package imports this module
    from forkd.controller.services.preview_domain import PreviewDomain


@dataclass
class Settings:
    state_dir: Path
    snapshot_root: Path
    run_dir: Path
    branch_concurrency: int = 4
    accel: str | None = None
    kill_on_exit: bool = False
    # Admission caps (None: no cap); `forkd serve` gives host-sized ones.
    max_sandboxes: int | None = None
    max_guest_memory_mib: int | None = None  # guest RAM of sandboxes + template builds
    memory_overcommit: float | None = None  # what max_guest_memory_mib was sized by, if it was
    # Admission by the host's real memory: what must stay available (None: not checked).
    memory_reserve_mib: int | None = None
    # Reclaim: below reclaim_low_mib of available memory, idle sandboxes are hibernated
    # until reclaim_high_mib is available (None: no reclaim); idle means no request
    # using it and no process output for reclaim_idle_s.
    reclaim_low_mib: int | None = None
    reclaim_high_mib: int | None = None
    reclaim_idle_s: float = 60.0
    # Free space a VM's memory (a branch, a template, a hibernation) is never written
    # into on the snapshot root's disk; reclaim keeps a guest's whole memory besides.
    disk_reserve_mib: int = DISK_RESERVE_MIB
    # Each VM's cgroup: <cgroup_root>/<cgroup_parent>/<vm id>; None: no cgroups.
    cgroup_parent: str | None = None
    cgroup_root: Path = Path("/sys/fs/cgroup")
    pool_size: int = 4  # the most QEMU processes kept warm per recently forked snapshot
    pool_memory_mib: int | None = None  # host memory all of them may hold; None: no cap
    network: str = "auto"  # "netns" (a namespace per VM), "user" (QEMU's NAT), or "auto"
    sandbox_cidr: str = "10.201.0.0/16"  # host-side addresses of the namespaces
    # Networks of the host's own that sandboxes may reach when their policy lets them;
    # by default none: not the host's addresses nor any network it is attached to.
    egress_host_networks: tuple[str, ...] = ()
    # The egress proxy (forkd.egress): every guest TCP connection decided by name. Off:
    # the namespace's rules decide by address alone (names resolved once at start).
    egress_proxy: bool = True
    egress_hosts: Path | None = None  # --egress-hosts: names pinned before DNS (hosts(5))
    egress_ca_file: Path | None = None  # --egress-ca-file: an operator's CA, for upstream TLS
    egress_rate: int | None = None  # --egress-rate: bytes/s each way, each sandbox; None: free
    max_upload_bytes: int = FILE_UPLOAD_LIMIT  # of one streamed file upload
    # OCI registries (host[:port]) spoken to over plain HTTP; the only ones on this host
    # that a push or a pull may reach (forkd.oci.policy).
    insecure_registries: tuple[str, ...] = ()
    default_registry: str | None = None  # host[:port] a short reference names; None: refused
    registry_auth: Path | None = None  # docker's config.json; None: $DOCKER_CONFIG or ~/.docker
    docker_host: str | None = None  # docker-daemon: references; None: $DOCKER_HOST, the default
    # The directories a client may name image archives and layouts under (docker-archive:,
    # oci-archive:, oci:): the daemon reads them with its own rights. None listed: refused.
    image_archive_dirs: tuple[Path, ...] = ()
    # --registry-policy FILE: more of the three above, read again when it changes.
    registry_policy: PolicyFile | None = None
    max_image_bytes: int = MAX_IMAGE_BYTES  # an imported image's files, expanded
    max_image_entries: int = MAX_IMAGE_ENTRIES  # in one layer, and merged
    import_timeout_secs: float = IMPORT_TIMEOUT_SECS  # one import, fetching and flattening
    # DNS name under which each preview URL gets a host of its own (forkd.controller.
    # preview_hosts); None: previews are on the daemon's own origin.
    preview_domain: PreviewDomain | None = None
    # Clients' connections: how long a request may take to arrive, how many may be open.
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    # Answers name a snapshot's files by where they are on the host (--show-host-paths),
    # not as paths of the daemon's own ("snapshots/TAG/vmstate"): a token holder learns
    # no host path unless the operator says so.
    show_host_paths: bool = False
    webhook_allow: tuple[str, ...] = ()  # --webhook-allow: non-public endpoints allowed
    # --otlp-endpoint: the OpenTelemetry collector traces and metrics go to (its base
    # URL, forkd.controller.otel); None: nothing of OpenTelemetry is loaded.
    otlp_endpoint: str | None = None
    # --shared-volume-size-mib: the most one shared volume (E2B's) holds, made sparse.
    shared_volume_mib: int = 1024
    # The key that seals secrets at rest (forkd.controller.secret_box); None:
    # $FORKD_SECRETS_KEY_FILE, else <state dir>/secrets.key, made at the first secret.
    secrets_key_file: Path | None = None

    def registries(self) -> RegistryChoices:
        """The registries, default registry and archive directories in force now: the
        command line's, with --registry-policy's file over them (read again if changed)."""
        if self.registry_policy is not None:
            return self.registry_policy.current()
        return RegistryChoices(
            self.insecure_registries, self.default_registry, self.image_archive_dirs
        )

    def shown_path(self, path: str | Path) -> str:
        """A file of a snapshot as answers name it: ``snapshots/<its path in the snapshot
        root>`` (the state directory's layout, wherever --snapshot-root is), or the host
        path itself with ``show_host_paths``."""
        if self.show_host_paths:
            return str(path)
        try:
            inside = Path(path).relative_to(self.snapshot_root)
        except ValueError:
            return Path(path).name  # not a snapshot's: its name alone
        return str(Path("snapshots") / inside)
