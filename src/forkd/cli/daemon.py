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
from forkd.cli.options import FormatOpt, JsonOpt, with_options
from forkd.cli.render import out
from forkd.cli.serve_options import ServeOptions
from forkd.errors import ForkdError

if TYPE_CHECKING:
    from forkd.controller.connection_limits import ConnectionLimits
    from forkd.controller.settings import Settings


def register(app: typer.Typer) -> None:
    """Add ``serve`` and ``doctor`` to ``app``."""
    app.command()(with_options(serve, ServeOptions))
    app.command()(doctor)


def serve(given: ServeOptions) -> None:
    """Run the forkd daemon (HTTP API v1). Clients need the token in <state-dir>/token."""
    require_server("serve")
    from forkd.controller.server import E2BPort
    from forkd.controller.server import serve as run_server

    try:
        _refuse_at_start(given.accel, given.insecure_registry, given.default_registry)
        settings = _settings(given)
        settings.registry_policy = _policy_file(given.registry_policy, settings)
        _use_qemu_user(given.qemu_user, given.vm_uid_range)
        run_server(
            settings,
            given.bind,
            given.token_file,
            given.log_level,
            insecure_no_auth=given.insecure_no_auth,
            e2b=E2BPort(given.e2b_bind, given.e2b_domain, given.e2b_public_ports)
            if given.e2b_bind is not None
            else None,
        )
    except (ForkdError, ValueError) as exc:
        raise fail(str(exc)) from exc


def _settings(o: ServeOptions) -> Settings:
    """The daemon's ``Settings`` from ``forkd serve``'s options; a bad one is a
    ValueError (or ForkdError) here, before anything starts."""
    from forkd.controller.settings import Settings

    return Settings(
        **_admission(o.max_sandboxes, o.max_guest_memory, o.memory_overcommit, o.memory_reserve),
        **_reclaim(o.reclaim_low, o.reclaim_high, o.reclaim_idle, o.memory_reserve),
        disk_reserve_mib=o.disk_reserve,
        cgroup_parent=_cgroup_parent(o.cgroup_parent),
        **_places(o.state_dir, o.snapshot_root),
        branch_concurrency=o.branch_concurrency,
        **_vms(o.accel, o.kill_on_exit, o.pool_size, o.pool_memory),
        **_networking(o.network, o.sandbox_cidr, o.egress_host_network),
        **_egress(
            o.egress_proxy, o.egress_hosts, o.egress_ca_file, o.secrets_key_file, o.egress_rate
        ),
        show_host_paths=o.show_host_paths,
        webhook_allow=tuple(o.webhook_allow or ()),
        otlp_endpoint=_otlp_endpoint(o.otlp_endpoint),
        shared_volume_mib=o.shared_volume_size_mib,
        max_upload_bytes=o.max_upload_mib << 20,
        **_image_sources(o.insecure_registry, o.default_registry, o.registry_auth, o.docker_host),
        preview_domain=_preview_domain(o.preview_domain),
        **_image_bounds(
            o.image_archive_dir, o.max_image_mib, o.max_image_entries, o.import_timeout
        ),
        connection_limits=connection_limits(
            o.header_timeout, o.body_idle_timeout, o.max_connections_per_address, o.max_connections
        ),
    )


def _refuse_at_start(accel: str | None, insecure: list[str] | None, default: str | None) -> None:
    """What makes ``forkd serve`` stop before it starts: an accelerator that cannot run
    VMs, registries that are no registries."""
    from forkd.accel import choose
    from forkd.oci.policy import RegistryPolicy

    choose(accel)
    RegistryPolicy.of(insecure or (), default)


def _otlp_endpoint(url: str | None) -> str | None:
    """--otlp-endpoint, checked before the daemon starts (the check needs nothing of
    OpenTelemetry)."""
    from forkd.controller.otel.endpoint import endpoint_base

    return None if url is None else endpoint_base(url)


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
