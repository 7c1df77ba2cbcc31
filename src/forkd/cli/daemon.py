"""``forkd serve`` runs the daemon; ``forkd doctor`` checks this host can run its VMs.

The daemon's own modules (FastAPI, uvicorn, the VM driver) are imported inside
``serve``, so the commands that only talk to a daemon never load them.
"""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from forkd.cli import render
from forkd.cli.extras import require_server
from forkd.cli.failures import fail
from forkd.cli.options import FormatOpt, JsonOpt
from forkd.cli.render import out
from forkd.errors import ForkdError
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

if TYPE_CHECKING:
    from forkd.controller.connection_limits import ConnectionLimits


def register(app: typer.Typer) -> None:
    """Add ``serve`` and ``doctor`` to ``app``."""
    app.command()(serve)
    app.command()(doctor)


_BindOpt = Annotated[str, typer.Option(envvar="FORKD_BIND", help="HOST:PORT or unix:/path/to.sock")]

_StateDirOpt = Annotated[
    Path | None,
    typer.Option(envvar="FORKD_STATE_DIR", help="Database, snapshots, audit log."),
]

_SnapshotRootOpt = Annotated[
    Path | None,
    typer.Option(envvar="FORKD_SNAPSHOT_ROOT", help="Default: <state-dir>/snapshots."),
]

_TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_TOKEN_FILE",
        help="Require the token in this file (default: <state-dir>/token, written "
        "on the first start, mode 0600).",
    ),
]

_InsecureNoAuthOpt = Annotated[
    bool,
    typer.Option(
        "--insecure-no-auth",
        help="Answer every request without a token. Anyone who reaches the address "
        "can run code in every sandbox.",
    ),
]

_BranchConcurrencyOpt = Annotated[
    int, typer.Option(envvar="FORKD_BRANCH_CONCURRENCY", min=1, max=64)
]

_AccelOpt = Annotated[str | None, typer.Option(envvar="FORKD_ACCEL", help="auto, kvm or tcg.")]

_KillOnExitOpt = Annotated[
    bool, typer.Option(help="Kill every sandbox on shutdown instead of leaving them.")
]

_PoolSizeOpt = Annotated[
    int,
    typer.Option(
        envvar="FORKD_POOL_SIZE",
        min=0,
        max=1024,
        help="The most QEMU processes kept warm per recently forked snapshot, as many as "
        "its largest recent fork request (0: none); --pool-memory caps them all.",
    ),
]

_PoolMemoryOpt = Annotated[
    int | None,
    typer.Option(
        "--pool-memory",
        envvar="FORKD_POOL_MEMORY_MIB",
        min=0,
        help="Host memory (MiB) all waiting pooled QEMUs may hold (default: 1/16 of RAM, "
        "256 to 4096).",
    ),
]

_MaxSandboxesOpt = Annotated[
    int | None,
    typer.Option(
        envvar="FORKD_MAX_SANDBOXES",
        min=1,
        help="Sandboxes running or starting at once; more is a 429 (default: what the "
        "host's memory holds at 48 MiB each above --memory-reserve, at most 1000).",
    ),
]

_MemoryOvercommitOpt = Annotated[
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

_MemoryReserveOpt = Annotated[
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

_ReclaimLowOpt = Annotated[
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

_ReclaimHighOpt = Annotated[
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

_ReclaimIdleOpt = Annotated[
    float,
    typer.Option(
        envvar="FORKD_RECLAIM_IDLE",
        min=0,
        metavar="SECONDS",
        help="A sandbox with no request and no process output this long is idle: reclaim "
        "may hibernate it.",
    ),
]

_DiskReserveOpt = Annotated[
    int,
    typer.Option(
        envvar="FORKD_DISK_RESERVE",
        min=0,
        metavar="MIB",
        help="Free disk under the snapshot root that no branch, template build or "
        "hibernation starts writing into; reclaim keeps a guest's memory free besides.",
    ),
]

_MaxGuestMemoryOpt = Annotated[
    int | None,
    typer.Option(
        envvar="FORKD_MAX_GUEST_MEMORY",
        min=128,
        metavar="MIB",
        help="Guest RAM of sandboxes and template builds together; more is a 429 "
        "(default: --memory-overcommit times the host's RAM).",
    ),
]

_CgroupParentOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_CGROUP_PARENT",
        help="Each VM's cgroup is <parent>/<vm id> (v2, or v1 per controller); "
        "'none': no cgroups, no memory, CPU or process caps.",
    ),
]

_NetworkOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_NETWORK",
        help="auto: a network namespace per VM when root with nftables, else QEMU's "
        "user-mode NAT without egress; netns; user.",
    ),
]

_SandboxCidrOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_SANDBOX_CIDR",
        help="Host-side addresses of the namespaces, a /30 per VM.",
    ),
]

_EgressHostNetworkOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--egress-host-network",
        envvar="FORKD_EGRESS_HOST_NETWORKS",
        help="A network (CIDR) of this host's own that sandboxes may reach when their "
        "policy lets them (repeatable). By default none is: not the host's addresses, "
        "nor any network it is attached to (its LAN, its gateway, container bridges).",
    ),
]

_ShowHostPathsOpt = Annotated[
    bool,
    typer.Option(
        "--show-host-paths",
        envvar="FORKD_SHOW_HOST_PATHS",
        help="Answers name a snapshot's files (dir, vmstate, memory) by their paths on this "
        "host, as the original forkd did; by default as the daemon's own "
        "(snapshots/TAG/vmstate), so a token holder learns no host path.",
    ),
]

_QemuUserOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_QEMU_USER",
        help="per-vm: once it has opened its files, each QEMU drops to a uid and gid of "
        "its own from --vm-uid-range; none: QEMU keeps the daemon's user. A user name "
        "(the old form) is taken as per-vm, with a warning.",
    ),
]

_VmUidRangeOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_VM_UID_RANGE",
        metavar="START-END",
        help="The uids (and gids, the same numbers) QEMUs drop to, one per running VM; "
        "no passwd entries needed. Give it to forkd alone: no user, no subuid range.",
    ),
]

_MaxUploadOpt = Annotated[
    int,
    typer.Option(
        "--max-upload-mib",
        envvar="FORKD_MAX_UPLOAD_MIB",
        min=1,
        help="Largest file upload, in MiB; it streams to the guest, whose free space is "
        "the real bound (507 when full).",
    ),
]

_InsecureRegistryOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--insecure-registry",
        envvar="FORKD_INSECURE_REGISTRIES",
        metavar="HOST[:PORT]",
        help="An OCI registry spoken to over plain HTTP; repeatable. The only registries "
        "plain HTTP goes to, and the only ones on this host (loopback) a push or pull may "
        "reach: list a local registry here.",
    ),
]

_DefaultRegistryOpt = Annotated[
    str | None,
    typer.Option(
        "--default-registry",
        envvar="FORKD_DEFAULT_REGISTRY",
        metavar="HOST[:PORT]",
        help="Where a reference without a registry host (python:3.12) points; docker.io "
        "adds Docker Hub's library/. Default: none, such references are refused.",
    ),
]

_RegistryAuthOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_REGISTRY_AUTH",
        help="docker's config.json with registry credentials (auths). Default: "
        "$DOCKER_CONFIG/config.json, else ~/.docker/config.json.",
    ),
]

_EgressProxyOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_EGRESS_PROXY",
        help="on: every TCP connection a guest opens goes through the daemon's egress "
        "proxy, decided by name (TLS SNI, HTTP Host), secrets put in on the way out. off: "
        "the kernel decides by address alone (names resolved once), no secrets.",
    ),
]

_EgressHostsOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_EGRESS_HOSTS",
        help="A hosts(5) file of names the egress proxy resolves before DNS: the "
        "operator's word, so they may point at private addresses (read again on change).",
    ),
]

_EgressCaFileOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_EGRESS_CA_FILE",
        help="PEM certificates the egress proxy also trusts when it connects to an "
        "intercepted host (an operator's private CA), besides the host's own store.",
    ),
]

_EgressRateOpt = Annotated[
    str,
    typer.Option(
        envvar="FORKD_EGRESS_RATE",
        help="Bytes a second each sandbox may move through the egress proxy, each way "
        "(e.g. 20M; a second's worth may come at once), or off.",
    ),
]
_SecretsKeyFileOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_SECRETS_KEY_FILE",
        help="The key that seals secrets at rest: 32 bytes, raw or base64, in a file only "
        "the daemon's user may read (never made: yours to keep). Default: "
        "<state-dir>/secrets.key, made at the first secret.",
    ),
]

_PreviewDomainOpt = Annotated[
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

_DockerHostOpt = Annotated[
    str | None,
    typer.Option(
        "--docker-host",
        envvar="FORKD_DOCKER_HOST",
        metavar="unix://PATH",
        help="The Docker Engine docker-daemon: image references are exported from; "
        "'none': such references are refused. Default: $DOCKER_HOST (unix:// only), "
        "else /var/run/docker.sock.",
    ),
]

_RegistryPolicyOpt = Annotated[
    Path | None,
    typer.Option(
        "--registry-policy",
        envvar="FORKD_REGISTRY_POLICY",
        metavar="FILE",
        help="A TOML file of more insecure_registries, a default_registry and "
        "image_archive_dirs, read again whenever it changes (and on SIGHUP): open or close "
        "a registry without a restart. See RUNBOOK.",
    ),
]

_ImageArchiveDirOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--image-archive-dir",
        envvar="FORKD_IMAGE_ARCHIVE_DIRS",
        metavar="DIR",
        help="A directory whose image archives and OCI layouts clients may import "
        "(docker-archive:, oci-archive:, oci: references); repeatable. The daemon reads "
        "them with its own rights, so none is allowed unless listed.",
    ),
]

_MaxImageOpt = Annotated[
    int,
    typer.Option(
        "--max-image-mib",
        envvar="FORKD_MAX_IMAGE_MIB",
        min=1,
        help="What an imported container image's files may expand to, in MiB (one layer, "
        "and all merged); an import past it is refused (400), however small its layers.",
    ),
]

_MaxImageEntriesOpt = Annotated[
    int,
    typer.Option(
        "--max-image-entries",
        envvar="FORKD_MAX_IMAGE_ENTRIES",
        min=1,
        help="Entries (files, directories, links) an imported image may hold, in one layer "
        "and all merged; past it the import is refused (400). Merging costs CPU by the entry.",
    ),
]
_ImportTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--import-timeout",
        envvar="FORKD_IMPORT_TIMEOUT",
        min=1,
        help="Seconds one image import may take in all, fetching and flattening; past it "
        "the import is stopped (504) and keeps nothing half-made.",
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

_LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning, error.")]


def serve(
    bind: _BindOpt = "127.0.0.1:8889",
    state_dir: _StateDirOpt = None,
    snapshot_root: _SnapshotRootOpt = None,
    token_file: _TokenFileOpt = None,
    insecure_no_auth: _InsecureNoAuthOpt = False,
    branch_concurrency: _BranchConcurrencyOpt = 4,
    accel: _AccelOpt = None,
    kill_on_exit: _KillOnExitOpt = False,
    pool_size: _PoolSizeOpt = 4,
    pool_memory: _PoolMemoryOpt = None,
    max_sandboxes: _MaxSandboxesOpt = None,
    max_guest_memory: _MaxGuestMemoryOpt = None,
    memory_overcommit: _MemoryOvercommitOpt = 4.0,
    memory_reserve: _MemoryReserveOpt = None,
    reclaim_low: _ReclaimLowOpt = None,
    reclaim_high: _ReclaimHighOpt = None,
    reclaim_idle: _ReclaimIdleOpt = RECLAIM_IDLE_SECS,
    disk_reserve: _DiskReserveOpt = DISK_RESERVE_MIB,
    cgroup_parent: _CgroupParentOpt = "forkd",
    network: _NetworkOpt = "auto",
    sandbox_cidr: _SandboxCidrOpt = "10.201.0.0/16",
    egress_host_network: _EgressHostNetworkOpt = None,
    show_host_paths: _ShowHostPathsOpt = False,
    qemu_user: _QemuUserOpt = "per-vm",
    vm_uid_range: _VmUidRangeOpt = str(DEFAULT_RANGE),
    max_upload_mib: _MaxUploadOpt = FILE_UPLOAD_LIMIT >> 20,
    insecure_registry: _InsecureRegistryOpt = None,
    default_registry: _DefaultRegistryOpt = None,
    registry_auth: _RegistryAuthOpt = None,
    docker_host: _DockerHostOpt = None,
    preview_domain: _PreviewDomainOpt = None,
    image_archive_dir: _ImageArchiveDirOpt = None,
    registry_policy: _RegistryPolicyOpt = None,
    max_image_mib: _MaxImageOpt = MAX_IMAGE_BYTES >> 20,
    max_image_entries: _MaxImageEntriesOpt = MAX_IMAGE_ENTRIES,
    import_timeout: _ImportTimeoutOpt = IMPORT_TIMEOUT_SECS,
    header_timeout: HeaderTimeoutOpt = REQUEST_HEADER_TIMEOUT_SECS,
    body_idle_timeout: BodyIdleTimeoutOpt = REQUEST_BODY_IDLE_TIMEOUT_SECS,
    max_connections_per_address: MaxConnectionsPerAddressOpt = MAX_CONNECTIONS_PER_ADDRESS,
    max_connections: MaxConnectionsOpt = None,
    egress_proxy: _EgressProxyOpt = "on",
    egress_hosts: _EgressHostsOpt = None,
    egress_ca_file: _EgressCaFileOpt = None,
    secrets_key_file: _SecretsKeyFileOpt = None,
    egress_rate: _EgressRateOpt = "off",
    log_level: _LogLevelOpt = "info",
) -> None:
    """Run the forkd daemon (HTTP API v1). Clients need the token in <state-dir>/token."""
    require_server("serve")
    from forkd.controller.server import serve as run_server
    from forkd.controller.settings import Settings

    try:
        _refuse_at_start(accel, insecure_registry, default_registry)
        settings = Settings(
            **_admission(max_sandboxes, max_guest_memory, memory_overcommit, memory_reserve),
            **_reclaim(reclaim_low, reclaim_high, reclaim_idle, memory_reserve),
            disk_reserve_mib=disk_reserve,
            cgroup_parent=_cgroup_parent(cgroup_parent),
            **_places(state_dir, snapshot_root),
            branch_concurrency=branch_concurrency,
            **_vms(accel, kill_on_exit, pool_size, pool_memory),
            **_networking(network, sandbox_cidr, egress_host_network),
            **_egress(egress_proxy, egress_hosts, egress_ca_file, secrets_key_file, egress_rate),
            show_host_paths=show_host_paths,
            max_upload_bytes=max_upload_mib << 20,
            **_image_sources(insecure_registry, default_registry, registry_auth, docker_host),
            preview_domain=_preview_domain(preview_domain),
            **_image_bounds(image_archive_dir, max_image_mib, max_image_entries, import_timeout),
            connection_limits=connection_limits(
                header_timeout, body_idle_timeout, max_connections_per_address, max_connections
            ),
        )
        settings.registry_policy = _policy_file(registry_policy, settings)
        _use_qemu_user(qemu_user, vm_uid_range)
        run_server(settings, bind, token_file, log_level, insecure_no_auth=insecure_no_auth)
    except (ForkdError, ValueError) as exc:
        raise fail(str(exc)) from exc


def _refuse_at_start(accel: str | None, insecure: list[str] | None, default: str | None) -> None:
    """What makes ``forkd serve`` stop before it starts: an accelerator that cannot run
    VMs, registries that are no registries."""
    from forkd.accel import choose
    from forkd.oci.policy import RegistryPolicy

    choose(accel)
    RegistryPolicy.of(insecure or (), default)


def _cgroup_parent(parent: str) -> str | None:
    from forkd.vmm.jail import cgroups

    return None if parent == "none" else cgroups.check_parent(parent)


def _preview_domain(domain: str | None) -> Any:
    from forkd.controller.services.preview_domain import PreviewDomain

    return PreviewDomain.of(domain) if domain else None


def _egress(
    proxy: str, hosts: Path | None, ca_file: Path | None, secrets_key: Path | None, rate: str
) -> dict[str, Any]:
    """The ``Settings`` of the egress proxy and secrets; a bad --egress-hosts or
    --egress-ca-file stops here, before anything starts."""
    from forkd.egress.ca import upstream_context
    from forkd.egress.resolver import PinnedHosts

    if proxy not in ("on", "off"):
        raise ValueError(f"--egress-proxy {proxy!r}: on or off")
    if hosts is not None:
        PinnedHosts(hosts.resolve())
    if ca_file is not None:
        try:
            upstream_context(ca_file.resolve())
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--egress-ca-file {ca_file}: not a PEM certificate: {exc}") from None
    return {
        "egress_proxy": proxy == "on",
        "egress_hosts": hosts.resolve() if hosts else None,
        "egress_ca_file": ca_file.resolve() if ca_file else None,
        "secrets_key_file": secrets_key,
        "egress_rate": _rate(rate),
    }


def _rate(text: str) -> int | None:
    """--egress-rate: ``off``, or bytes a second such as ``20M`` (``/s`` may follow)."""
    from forkd.egress.meter import parse_rate

    try:
        return parse_rate(text)
    except ValueError as exc:
        raise ValueError(f"--egress-rate {exc}") from None


def _policy_file(path: Path | None, settings: Any) -> Any:
    """--registry-policy: the file over the command line's registries, read now."""
    from forkd.controller.registry_policy_file import PolicyFile

    if path is None:
        return None
    policy = PolicyFile(path.resolve(), settings.registries())
    policy.check()
    return policy


def _places(state_dir: Path | None, snapshot_root: Path | None) -> dict[str, Any]:
    """Where ``forkd serve`` keeps its state, snapshots and running VMs' files."""
    from forkd import paths

    sd = (state_dir or paths.state_dir()).resolve()
    return {
        "state_dir": sd,
        "run_dir": sd / "run",
        "snapshot_root": (snapshot_root or sd / "snapshots").resolve(),
    }


def _vms(
    accel: str | None, kill_on_exit: bool, pool_size: int, pool_memory: int | None
) -> dict[str, Any]:
    """The ``Settings`` of ``forkd serve``'s options for its VMs and their warm pool."""
    return {
        "accel": accel,
        "kill_on_exit": kill_on_exit,
        "pool_size": pool_size,
        "pool_memory_mib": _pool_memory(pool_memory),
    }


def _networking(network: str, cidr: str, host_networks: list[str] | None) -> dict[str, Any]:
    """The ``Settings`` of ``forkd serve``'s network options."""
    return {
        "network": _network(network),
        "sandbox_cidr": cidr,
        "egress_host_networks": tuple(host_networks or ()),
    }


def _image_bounds(
    archive_dirs: list[Path] | None, max_mib: int, max_entries: int, timeout: float
) -> dict[str, Any]:
    """The ``Settings`` of ``forkd serve``'s options that bound an image import."""
    return {
        "image_archive_dirs": tuple(d.resolve() for d in archive_dirs or ()),
        "max_image_bytes": max_mib << 20,
        "max_image_entries": max_entries,
        "import_timeout_secs": timeout,
    }


def _image_sources(
    insecure: list[str] | None, default: str | None, auth: Path | None, docker_host: str | None
) -> dict[str, Any]:
    """Where images come from: the ``Settings`` of ``forkd serve``'s registry options."""
    return {
        "insecure_registries": tuple(insecure or ()),
        "default_registry": default,
        "registry_auth": auth,
        "docker_host": docker_host,
    }


def connection_limits(
    header_timeout: float,
    body_idle_timeout: float,
    max_per_address: int,
    max_total: int | None,
) -> ConnectionLimits:
    """The connection options of ``forkd serve`` and ``forkd gateway``; the total sized
    for this process's open-file limit when not given."""
    from forkd import limits
    from forkd.controller.connection_limits import ConnectionLimits

    return ConnectionLimits(
        header_timeout_secs=header_timeout,
        body_idle_timeout_secs=body_idle_timeout,
        max_per_address=max_per_address,
        max_total=limits.default_max_connections() if max_total is None else max_total,
    )


def _use_qemu_user(choice: str, uid_range: str) -> None:
    """From now on each QEMU drops to a uid of its own from ``uid_range``, or keeps the
    daemon's user (``choice`` none).

    A user name was the old form: every QEMU dropped to that one user, so a guest
    that escaped into its QEMU could signal every other. It now means per-vm: no
    file QEMU opens after the drop needs the user, and keeping the shared user
    behind an option would keep that hole open.
    """
    from forkd.cli.render import err
    from forkd.vmm.jail import qemu_user

    if choice == "none":
        qemu_user.configure(None)
        return
    uids = qemu_user.UidRange.parse(uid_range)
    if choice != "per-vm":
        err.print(
            f"[yellow]warning:[/] --qemu-user {choice} is deprecated: each QEMU drops to a "
            f"uid of its own from --vm-uid-range {uids} instead (say --qemu-user per-vm)",
            highlight=False,
            markup=True,
        )
    if os.geteuid() == 0:
        for name in qemu_user.users_in(uids):
            err.print(
                f"[yellow]warning:[/] {name} is in --vm-uid-range {uids}: a QEMU "
                "given that id could signal its processes and read its files",
                highlight=False,
                markup=True,
            )
    qemu_user.configure(uids)


def _admission(
    max_sandboxes: int | None,
    max_guest_memory: int | None,
    overcommit: float,
    reserve: int | None,
) -> dict[str, Any]:
    """The admission settings: the caps given, else sized for this host (see
    :mod:`forkd.limits`)."""
    from forkd import limits

    ram = host_ram_mib()
    return {
        "max_sandboxes": max_sandboxes or limits.default_max_sandboxes(ram),
        "max_guest_memory_mib": (
            max_guest_memory or limits.overcommitted_guest_memory_mib(overcommit, ram)
        ),
        "memory_overcommit": None if max_guest_memory else overcommit,
        "memory_reserve_mib": _reserve_mib(reserve),
    }


def _reserve_mib(given: int | None) -> int:
    """``--memory-reserve``, else a sixteenth of the RAM (:func:`host_ram_mib`)."""
    from forkd import limits

    return limits.default_memory_reserve_mib(host_ram_mib()) if given is None else given


def host_ram_mib() -> int:
    """The RAM the daemon's defaults are sized by: the host's, or the memory limit of
    the cgroup it sees as its root when that is less (a daemon in a container)."""
    from forkd import limits
    from forkd.vmm.jail import memory_limit

    host = limits.host_memory_mib()
    limited = memory_limit.enclosing()
    return host if limited is None else min(host, limited.limit_mib)


def _pool_memory(given: int | None) -> int:
    from forkd import limits

    return limits.default_pool_memory_mib(host_ram_mib()) if given is None else given


def _network(mode: str) -> str:
    if mode not in ("auto", "netns", "user"):
        raise ValueError(f"--network must be auto, netns or user, not {mode!r}")
    return mode


def _reclaim(low: int | None, high: int | None, idle: float, reserve: int | None) -> dict[str, Any]:
    """The reclaim settings: the watermarks given, else sized by the reserve."""
    from forkd import limits

    default_low, default_high = limits.default_reclaim_watermarks(_reserve_mib(reserve))
    low = default_low if low is None else low
    high = max(low, default_high if high is None else high)
    return {
        "reclaim_low_mib": low or None,
        "reclaim_high_mib": high if low else None,
        "reclaim_idle_s": idle,
    }


def _daemon_check(url: str, token: str | None) -> Any:
    """The daemon at ``url`` answers, and takes the token the CLI would send (a warning
    when it does not: the host may still run VMs)."""
    from forkd import doctor as doc
    from forkd.client import Controller, ControllerError

    try:
        with Controller(url, token=token, timeout=5) as ctl:
            count = len(ctl.list_snapshots())
    except ControllerError as exc:
        fix = (
            "set FORKD_TOKEN, --daemon-token or FORKD_TOKEN_FILE"
            if exc.status == 401
            else "start it: forkd serve (or check the address)"
        )
        return doc.Check("daemon", False, f"{url}: {exc.message}", fix, fatal=False)
    return doc.Check("daemon", True, f"{url} answers: {count} snapshot(s)")


def doctor(
    as_json: JsonOpt = False,
    output_format: FormatOpt = None,
    daemon_url: Annotated[
        str | None,
        typer.Option(
            "--daemon-url",
            "--url",
            help="Also check the daemon there (the "
            "original forkd's doctor did): does it answer, does the token work.",
        ),
    ] = None,
    daemon_token: Annotated[
        str | None, typer.Option("--daemon-token", help="Its token (default: as every verb).")
    ] = None,
) -> None:
    """Check that this host can run forkd VMs; exit 1 with what to fix if not."""
    as_json = as_json or output_format == "json"
    require_server("doctor")
    from forkd import doctor as doc

    checks = doc.run_checks()
    if daemon_url is not None:
        checks.append(_daemon_check(daemon_url, daemon_token))
    ok = doc.can_run_vms(checks)
    if as_json:
        print(json.dumps({"ok": ok, "checks": [c.__dict__ for c in checks]}))
    else:
        table = render.wrapping_table("check", "", "detail", "fix")
        for c in checks:
            mark = "[green]ok[/]" if c.ok else ("[red]FAIL[/]" if c.fatal else "[yellow]warn[/]")
            table.add_row(c.name, mark, c.detail, "" if c.ok else c.fix)
        out.print(table)
        out.print(
            "[green]this host can run forkd VMs[/]"
            if ok
            else "[red]this host cannot run forkd VMs[/]"
        )
    if not ok:
        raise typer.Exit(1)
