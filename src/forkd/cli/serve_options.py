"""The options of ``forkd serve`` (each with its environment variable and help), and of
``forkd gateway`` where the two share them; :class:`ServeOptions`, what ``forkd serve``
was given."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from forkd.cli.serve_image_options import (
    DefaultRegistryOpt,
    DockerHostOpt,
    ImageArchiveDirOpt,
    ImportTimeoutOpt,
    InsecureRegistryOpt,
    MaxImageEntriesOpt,
    MaxImageOpt,
    RegistryAuthOpt,
    RegistryPolicyOpt,
)
from forkd.limits import (
    DISK_RESERVE_MIB,
    FILE_UPLOAD_LIMIT,
    IMPORT_TIMEOUT_SECS,
    MAX_CONNECTIONS_PER_ADDRESS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_ENTRIES,
    RECLAIM_IDLE_SECS,
    REQUEST_BODY_IDLE_TIMEOUT_SECS,
    REQUEST_HEADER_TIMEOUT_SECS,
)
from forkd.vmm.jail.qemu_user import DEFAULT_RANGE

BindOpt = Annotated[str, typer.Option(envvar="FORKD_BIND", help="HOST:PORT or unix:/path/to.sock")]

E2bBindOpt = Annotated[
    str | None,
    typer.Option(
        "--e2b-bind",
        envvar="FORKD_E2B_BIND",
        metavar="HOST:PORT",
        help="Also serve E2B's API on this port (E2B_API_URL and E2B_SANDBOX_URL of E2B's "
        "SDKs; E2B_API_KEY is the daemon's token, or forkd token --e2b). Default: off.",
    ),
]

E2bDomainOpt = Annotated[
    str | None,
    typer.Option(
        "--e2b-domain",
        envvar="FORKD_E2B_DOMAIN",
        metavar="DOMAIN",
        help="Where E2B's sandbox.get_host(port) points: <port>-<sandbox>.DOMAIN, a wildcard "
        "name (and port) reaching the E2B port. Default: localhost:<the E2B port>.",
    ),
]

E2bPublicPortsOpt = Annotated[
    bool,
    typer.Option(
        "--e2b-public-ports",
        envvar="FORKD_E2B_PUBLIC_PORTS",
        help="Serve a sandbox's ports on their get_host names without E2B's traffic token "
        "(as E2B's public sandboxes). Default: the token is asked for.",
    ),
]

WebhookAllowOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--webhook-allow",
        envvar="FORKD_WEBHOOK_ALLOW",
        metavar="HOST[:PORT]",
        help="A webhook endpoint on a loopback, link-local or private address that "
        "deliveries may reach; repeatable. Without it only public addresses are.",
    ),
]

OtlpEndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--otlp-endpoint",
        envvar="FORKD_OTLP_ENDPOINT",
        metavar="URL",
        help="Send traces (a span per request, with its fork, restore, branch, import and "
        "wake steps) and metrics to this OpenTelemetry collector over OTLP/HTTP, e.g. "
        "http://collector:4318. Default: none; nothing of OpenTelemetry is loaded.",
    ),
]

SharedVolumeSizeOpt = Annotated[
    int,
    typer.Option(
        "--shared-volume-size-mib",
        envvar="FORKD_SHARED_VOLUME_SIZE_MIB",
        min=16,
        max=1 << 20,
        metavar="MIB",
        help="The most one shared volume (E2B's volumes) holds; each is a sparse file "
        "that takes only what is written to it.",
    ),
]

StateDirOpt = Annotated[
    Path | None,
    typer.Option(envvar="FORKD_STATE_DIR", help="Database, snapshots, audit log."),
]

SnapshotRootOpt = Annotated[
    Path | None,
    typer.Option(envvar="FORKD_SNAPSHOT_ROOT", help="Default: <state-dir>/snapshots."),
]

TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_TOKEN_FILE",
        help="Require the token in this file (default: <state-dir>/token, written "
        "on the first start, mode 0600).",
    ),
]

InsecureNoAuthOpt = Annotated[
    bool,
    typer.Option(
        "--insecure-no-auth",
        help="Answer every request without a token. Anyone who reaches the address "
        "can run code in every sandbox.",
    ),
]

BranchConcurrencyOpt = Annotated[
    int, typer.Option(envvar="FORKD_BRANCH_CONCURRENCY", min=1, max=64)
]

AccelOpt = Annotated[str | None, typer.Option(envvar="FORKD_ACCEL", help="auto, kvm or tcg.")]

KillOnExitOpt = Annotated[
    bool, typer.Option(help="Kill every sandbox on shutdown instead of leaving them.")
]

PoolSizeOpt = Annotated[
    int,
    typer.Option(
        envvar="FORKD_POOL_SIZE",
        min=0,
        max=1024,
        help="The most QEMU processes kept warm per recently forked snapshot, as many as "
        "its largest recent fork request (0: none); --pool-memory caps them all.",
    ),
]

PoolMemoryOpt = Annotated[
    int | None,
    typer.Option(
        "--pool-memory",
        envvar="FORKD_POOL_MEMORY_MIB",
        min=0,
        help="Host memory (MiB) all waiting pooled QEMUs may hold (default: 1/16 of RAM, "
        "256 to 4096).",
    ),
]

MaxSandboxesOpt = Annotated[
    int | None,
    typer.Option(
        envvar="FORKD_MAX_SANDBOXES",
        min=1,
        help="Sandboxes running or starting at once; more is a 429 (default: what the "
        "host's memory holds at 48 MiB each above --memory-reserve, at most 1000).",
    ),
]

MemoryOvercommitOpt = Annotated[
    float,
    typer.Option(
        envvar="FORKD_MEMORY_OVERCOMMIT",
        min=0.1,
        max=100.0,
        metavar="RATIO",
        help="Guest RAM given to sandboxes and template builds, over the host's RAM: what "
        "they would take if every guest filled its memory; more is a 429.",
    ),
]

MemoryReserveOpt = Annotated[
    int | None,
    typer.Option(
        envvar="FORKD_MEMORY_RESERVE",
        min=0,
        metavar="MIB",
        help="Host memory kept available: a sandbox whose real share would not fit above "
        "it is a 429 (default: a sixteenth of the RAM, at least 1024).",
        show_default=False,
    ),
]

ReclaimLowOpt = Annotated[
    int | None,
    typer.Option(
        envvar="FORKD_RECLAIM_LOW",
        min=0,
        metavar="MIB",
        help="Low watermark: when the host has less memory available, idle sandboxes are "
        "hibernated, least recently used first (default: twice --memory-reserve; 0: never).",
        show_default=False,
    ),
]

ReclaimHighOpt = Annotated[
    int | None,
    typer.Option(
        envvar="FORKD_RECLAIM_HIGH",
        min=0,
        metavar="MIB",
        help="High watermark: reclaim stops once this much is available (default: three "
        "times --memory-reserve).",
        show_default=False,
    ),
]

ReclaimIdleOpt = Annotated[
    float,
    typer.Option(
        envvar="FORKD_RECLAIM_IDLE",
        min=0,
        metavar="SECONDS",
        help="A sandbox with no request and no process output this long is idle: reclaim "
        "may hibernate it.",
    ),
]

DiskReserveOpt = Annotated[
    int,
    typer.Option(
        envvar="FORKD_DISK_RESERVE",
        min=0,
        metavar="MIB",
        help="Free disk under the snapshot root that no branch, template build or "
        "hibernation starts writing into; reclaim keeps a guest's memory free besides.",
    ),
]

MaxGuestMemoryOpt = Annotated[
    int | None,
    typer.Option(
        envvar="FORKD_MAX_GUEST_MEMORY",
        min=128,
        metavar="MIB",
        help="Guest RAM of sandboxes and template builds together; more is a 429 "
        "(default: --memory-overcommit times the host's RAM).",
    ),
]

CgroupParentOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_CGROUP_PARENT",
        help="Each VM's cgroup is <parent>/<vm id> (v2, or v1 per controller); "
        "'none': no cgroups, no memory, CPU or process caps.",
    ),
]

NetworkOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_NETWORK",
        help="auto: a network namespace per VM when root with nftables, else QEMU's "
        "user-mode NAT without egress; netns; user.",
    ),
]

SandboxCidrOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_SANDBOX_CIDR",
        help="Host-side addresses of the namespaces, a /30 per VM.",
    ),
]

EgressHostNetworkOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--egress-host-network",
        envvar="FORKD_EGRESS_HOST_NETWORKS",
        help="A network (CIDR) of this host's own that sandboxes may reach when their "
        "policy lets them (repeatable). By default none is: not the host's addresses, "
        "nor any network it is attached to (its LAN, its gateway, container bridges).",
    ),
]

ShowHostPathsOpt = Annotated[
    bool,
    typer.Option(
        "--show-host-paths",
        envvar="FORKD_SHOW_HOST_PATHS",
        help="Answers name a snapshot's files (dir, vmstate, memory) by their paths on this "
        "host, as the original forkd did; by default as the daemon's own "
        "(snapshots/TAG/vmstate), so a token holder learns no host path.",
    ),
]

QemuUserOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_QEMU_USER",
        help="per-vm: once it has opened its files, each QEMU drops to a uid and gid of "
        "its own from --vm-uid-range; none: QEMU keeps the daemon's user. A user name "
        "(the old form) is taken as per-vm, with a warning.",
    ),
]

VmUidRangeOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_VM_UID_RANGE",
        metavar="START-END",
        help="The uids (and gids, the same numbers) QEMUs drop to, one per running VM; "
        "no passwd entries needed. Give it to forkd alone: no user, no subuid range.",
    ),
]

MaxUploadOpt = Annotated[
    int,
    typer.Option(
        "--max-upload-mib",
        envvar="FORKD_MAX_UPLOAD_MIB",
        min=1,
        help="Largest file upload, in MiB; it streams to the guest, whose free space is "
        "the real bound (507 when full).",
    ),
]

EgressProxyOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_EGRESS_PROXY",
        help="on: every TCP connection a guest opens goes through the daemon's egress "
        "proxy, decided by name (TLS SNI, HTTP Host), secrets put in on the way out. off: "
        "the kernel decides by address alone (names resolved once), no secrets.",
    ),
]

EgressHostsOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_EGRESS_HOSTS",
        help="A hosts(5) file of names the egress proxy resolves before DNS: the "
        "operator's word, so they may point at private addresses (read again on change).",
    ),
]

EgressCaFileOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_EGRESS_CA_FILE",
        help="PEM certificates the egress proxy also trusts when it connects to an "
        "intercepted host (an operator's private CA), besides the host's own store.",
    ),
]

EgressRateOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_EGRESS_RATE",
        help="Bytes a second each sandbox may move through the egress proxy, each way "
        "(e.g. 20M; a second's worth may come at once), or off.",
    ),
]
SecretsKeyFileOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_SECRETS_KEY_FILE",
        help="The key that seals secrets at rest: 32 bytes, raw or base64, in a file only "
        "the daemon's user may read (never made: yours to keep). Default: "
        "<state-dir>/secrets.key, made at the first secret.",
    ),
]

PreviewDomainOpt = Annotated[
    str | None,
    typer.Option(
        "--preview-domain",
        envvar="FORKD_PREVIEW_DOMAIN",
        metavar="[SCHEME://]DOMAIN[:PORT]",
        help="Give each preview URL a host of its own, PORT-SANDBOX.DOMAIN (point a "
        "wildcard DNS record *.DOMAIN at this daemon): a browser origin per sandbox and "
        "port, apart from the API and the console. Scheme and port default to those the "
        "URL was asked by. Default: previews are on the daemon's own origin.",
    ),
]

HeaderTimeoutOpt = Annotated[
    float,
    typer.Option(
        envvar="FORKD_HEADER_TIMEOUT",
        min=0.1,
        metavar="SECS",
        help="A connection sends a whole request head within this long of opening, or of "
        "its last answer (the idle keep-alive wait), or it is closed.",
    ),
]

BodyIdleTimeoutOpt = Annotated[
    float,
    typer.Option(
        envvar="FORKD_BODY_IDLE_TIMEOUT",
        min=0.1,
        metavar="SECS",
        help="While a request body is being read, this long without a byte closes the "
        "connection. Never while an answer streams or a WebSocket is open.",
    ),
]

MaxConnectionsPerAddressOpt = Annotated[
    int,
    typer.Option(
        envvar="FORKD_MAX_CONNECTIONS_PER_ADDRESS",
        min=1,
        help="Connections open at once from one client IP address; more are refused (503). "
        "Unix-socket clients count against --max-connections only. Behind a proxy, every "
        "client has the proxy's address.",
    ),
]

MaxConnectionsOpt = Annotated[
    int | None,
    typer.Option(
        envvar="FORKD_MAX_CONNECTIONS",
        min=1,
        help="Client connections open at once, WebSockets included; more are refused (503) "
        "(default: 1024, or half the open-file limit when that is less).",
        show_default=False,
    ),
]

LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning, error.")]


@dataclass(frozen=True)
class ServeOptions:
    """Every option of ``forkd serve``, in the order its help lists them, with its
    default: the command's signature is made of these fields (see
    :func:`forkd.cli.options.with_options`)."""

    bind: BindOpt = "127.0.0.1:8889"
    state_dir: StateDirOpt = None
    snapshot_root: SnapshotRootOpt = None
    token_file: TokenFileOpt = None
    insecure_no_auth: InsecureNoAuthOpt = False
    branch_concurrency: BranchConcurrencyOpt = 4
    accel: AccelOpt = None
    kill_on_exit: KillOnExitOpt = False
    pool_size: PoolSizeOpt = 4
    pool_memory: PoolMemoryOpt = None
    max_sandboxes: MaxSandboxesOpt = None
    max_guest_memory: MaxGuestMemoryOpt = None
    memory_overcommit: MemoryOvercommitOpt = 4.0
    memory_reserve: MemoryReserveOpt = None
    reclaim_low: ReclaimLowOpt = None
    reclaim_high: ReclaimHighOpt = None
    reclaim_idle: ReclaimIdleOpt = RECLAIM_IDLE_SECS
    disk_reserve: DiskReserveOpt = DISK_RESERVE_MIB
    cgroup_parent: CgroupParentOpt = "forkd"
    network: NetworkOpt = "auto"
    sandbox_cidr: SandboxCidrOpt = "10.201.0.0/16"
    egress_host_network: EgressHostNetworkOpt = None
    show_host_paths: ShowHostPathsOpt = False
    qemu_user: QemuUserOpt = "per-vm"
    vm_uid_range: VmUidRangeOpt = str(DEFAULT_RANGE)
    max_upload_mib: MaxUploadOpt = FILE_UPLOAD_LIMIT >> 20
    insecure_registry: InsecureRegistryOpt = None
    default_registry: DefaultRegistryOpt = None
    registry_auth: RegistryAuthOpt = None
    docker_host: DockerHostOpt = None
    preview_domain: PreviewDomainOpt = None
    image_archive_dir: ImageArchiveDirOpt = None
    registry_policy: RegistryPolicyOpt = None
    max_image_mib: MaxImageOpt = MAX_IMAGE_BYTES >> 20
    max_image_entries: MaxImageEntriesOpt = MAX_IMAGE_ENTRIES
    import_timeout: ImportTimeoutOpt = IMPORT_TIMEOUT_SECS
    header_timeout: HeaderTimeoutOpt = REQUEST_HEADER_TIMEOUT_SECS
    body_idle_timeout: BodyIdleTimeoutOpt = REQUEST_BODY_IDLE_TIMEOUT_SECS
    max_connections_per_address: MaxConnectionsPerAddressOpt = MAX_CONNECTIONS_PER_ADDRESS
    max_connections: MaxConnectionsOpt = None
    egress_proxy: EgressProxyOpt = "on"
    egress_hosts: EgressHostsOpt = None
    egress_ca_file: EgressCaFileOpt = None
    secrets_key_file: SecretsKeyFileOpt = None
    egress_rate: EgressRateOpt = "off"
    log_level: LogLevelOpt = "info"
    e2b_bind: E2bBindOpt = None
    e2b_domain: E2bDomainOpt = None
    e2b_public_ports: E2bPublicPortsOpt = False
    webhook_allow: WebhookAllowOpt = None
    otlp_endpoint: OtlpEndpointOpt = None
    shared_volume_size_mib: SharedVolumeSizeOpt = 1024
