"""``forkd snapshot create``: a template built from an image (a recipe's or a container
image's), its setup and warm-up commands run, its server started and waited for,
then snapshotted; its volumes, network and environment as given."""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from forkd.cli import render
from forkd.cli.build_progress import following_build
from forkd.cli.failures import daemon_errors, fail
from forkd.cli.labels import LabelOpt, parse_labels
from forkd.cli.network_options import AllowOutOpt, DenyOutOpt, EnvOpt, env_of, network_of
from forkd.cli.options import Connection
from forkd.cli.render import err, out, shown
from forkd.cli.stop_options import OnStopOpt, OnStopTimeoutOpt

StartOpt = Annotated[
    bool, typer.Option("--start", help="Run the image's Entrypoint+Cmd before the snapshot.")
]
ReadyPortOpt = Annotated[
    int | None,
    typer.Option(
        "--ready-port", help="With --start: wait until this port listens.", min=1, max=65535
    ),
]
ReadyCmdOpt = Annotated[
    str | None,
    typer.Option("--ready-cmd", help="With --start: wait until this shell line exits 0."),
]
ReadyTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--ready-timeout",
        help="Seconds --start may take to be ready (default: 120). Without --ready-port "
        "or --ready-cmd, the image's one exposed port is waited for, if it has one.",
        show_default=False,
    ),
]


ImageOpt = Annotated[
    str | None,
    typer.Option(
        "--image",
        help="A built image (default: python), or a container image to import first: "
        "registry/repo:tag, docker-daemon:IMAGE, docker-archive:PATH, oci-archive:PATH, "
        "oci:DIR.",
    ),
]


def _started(
    start: bool, ready_port: int | None, ready_cmd: str | None, ready_timeout: float | None
) -> dict[str, Any]:
    """The request's fields for a template that starts a server (the ones given)."""
    started = {
        "start": start or None,
        "ready_port": ready_port,
        "ready_cmd": ["/bin/sh", "-c", ready_cmd] if ready_cmd else None,
        "ready_timeout_secs": ready_timeout,
    }
    return {k: v for k, v in started.items() if v is not None}


NewTagOpt = Annotated[str, typer.Option("--tag", help="Name of the new snapshot.")]
MemoryOpt = Annotated[int | None, typer.Option("--memory", help="Guest RAM in MiB.", min=1)]
VcpusOpt = Annotated[int | None, typer.Option("--vcpus", help="Virtual CPUs.", min=1)]
SetupOpt = Annotated[
    list[str] | None,
    typer.Option("--setup", help="Shell command to run before the snapshot (repeatable)."),
]
WarmupOpt = Annotated[
    str | None,
    typer.Option("--warmup", help="Python run in the agent's interpreter, e.g. imports."),
]
BootWaitOpt = Annotated[
    float | None, typer.Option("--boot-wait-secs", help="How long to wait for the boot.")
]
VolumeOpt = Annotated[
    list[str] | None,
    typer.Option("--volume", help="Attach NAME:/mnt/path[:ro] (repeatable)."),
]


def snapshot_create(
    conn: Connection,
    tag: NewTagOpt,
    image: ImageOpt = None,
    memory: MemoryOpt = None,
    vcpus: VcpusOpt = None,
    setup: SetupOpt = None,
    warmup: WarmupOpt = None,
    boot_wait_secs: BootWaitOpt = None,
    volume: VolumeOpt = None,
    label: LabelOpt = None,
    start: StartOpt = False,
    ready_port: ReadyPortOpt = None,
    ready_cmd: ReadyCmdOpt = None,
    ready_timeout: ReadyTimeoutOpt = None,
    allow_out: AllowOutOpt = None,
    deny_out: DenyOutOpt = None,
    env: EnvOpt = None,
    on_stop: OnStopOpt = None,
    on_stop_timeout: OnStopTimeoutOpt = None,
) -> None:
    """Boot a template VM, run setup and warm-up, snapshot it under TAG."""
    volumes = [parse_volume(host_file_volume(conn, v)) for v in volume or []]
    labels = parse_labels(label)
    t0 = time.monotonic()
    if image is not None and _is_container_ref(image):
        from forkd.cli.images import import_with_progress

        _check_tag_is_free(conn, tag)  # before an import that may take minutes
        image = str(import_with_progress(conn, image, t0, quiet=True)["name"])
    status = _build_status(tag, start, ready_port, ready_cmd)
    extra = _started(start, ready_port, ready_cmd, ready_timeout)
    extra.update(_given(volumes, labels, network_of(allow_out, deny_out), env_of(env)))
    if on_stop is not None:  # every fork of it runs it before it is stopped
        extra.update(on_stop=on_stop, on_stop_timeout_s=on_stop_timeout or 10.0)
    with (
        daemon_errors(),
        conn.controller() as ctl,
        err.status(status) as shown_status,
        following_build(conn, tag, shown_status),
    ):
        info = ctl.create_snapshot(
            tag,
            image=image,
            memory_mib=memory,
            vcpus=vcpus,
            setup=setup or None,
            warmup=warmup,
            boot_wait_secs=boot_wait_secs,
            **extra,
        )
    if conn.as_json:
        render.print_json(info)
        return
    _show_created(info, tag, time.monotonic() - t0)


def _given(
    volumes: list[dict[str, object]],
    labels: dict[str, str] | None,
    network: dict[str, Any] | None,
    env: dict[str, str] | None,
) -> dict[str, Any]:
    """The request's fields for the template's volumes and labels (when there are
    some), its network policy and its environment (when given)."""
    given: dict[str, Any] = {}
    if volumes:
        given["volumes"] = volumes
    if labels:
        given["metadata"] = labels
    for key, value in (("network", network), ("env", env)):
        if value is not None:
            given[key] = value
    return given


def _show_created(info: dict[str, Any], tag: str, took: float) -> None:
    err.print(f"snapshot {shown(tag)} ready in {took:.1f} s")
    if info.get("start"):
        err.print(f"start: {shown(info['start'])}", highlight=False)
    out.print(render.kv_table(info))


def _check_tag_is_free(conn: Connection, tag: str) -> None:
    """Exit 1 when snapshot ``tag`` exists (the daemon would refuse it only after the
    import this command runs first)."""
    from forkd.client import ControllerError

    with daemon_errors(), conn.controller() as ctl:
        try:
            ctl.snapshot(tag)
        except ControllerError as exc:
            if exc.status == 404:
                return
            raise
    raise fail(
        f"snapshot {shown(tag)} exists: choose another --tag, or remove it first "
        f"(forkd rmi {shown(tag)})"
    )


def _build_status(tag: str, start: bool, ready_port: int | None, ready_cmd: str | None) -> str:
    """What snapshot create says while the daemon works: its steps, and what start waits for."""
    waits = (
        f"port {ready_port} to listen"
        if ready_port
        else f"{ready_cmd!r} to exit 0"
        if ready_cmd
        else "its one exposed port, if it has one"
    )
    steps = f"start (waiting for {shown(waits)}), " if start else ""
    return f"building snapshot {shown(tag)}: boot, setup, warm-up, {steps}snapshot"


def _is_container_ref(image: str) -> bool:
    """A container image reference rather than the name of a built image."""
    return any(c in image for c in ":/@")


def host_file_volume(conn: Connection, text: str) -> str:
    """``FILE.ext4:/mnt/data[:ro]`` (the original forkd's form: an ext4 image on this
    host) as ``NAME:/mnt/data[:ro]``, the file sent to the daemon as volume NAME first
    (once: the same file, unchanged, is that volume again); any other text as it is."""
    source, sep, rest = text.partition(":")
    looks_like_a_file = "/" in source or source.endswith((".ext4", ".img"))
    if not sep or not looks_like_a_file:
        return text
    path = Path(source).expanduser()
    if not path.is_file():
        raise typer.BadParameter(f"--volume {text!r}: there is no file {source}")
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", path.stem).strip("-")[:48] or "volume"
    name = f"{stem}-{hashlib.sha256(ident).hexdigest()[:8]}"
    with daemon_errors(), conn.controller() as ctl:
        if any(v.get("name") == name for v in ctl.list_volumes()):
            err.print(f"volume {shown(name)} holds {shown(source)} already", highlight=False)
        else:
            err.print(
                f"importing {shown(source)} as volume {shown(name)}: copy-on-write, the "
                "file itself is never changed (each sandbox writes a layer of its own)",
                highlight=False,
            )
            with err.status(f"sending {shown(source)}") as status:
                ctl.import_volume(name, path, status.update)
    return f"{name}:{rest}"


def parse_volume(text: str) -> dict[str, object]:
    """``NAME:/mnt/path[:ro]`` → the API's volume attachment."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].startswith("/") or parts[2:] not in ([], ["ro"]):
        raise typer.BadParameter(f"{text!r}: use NAME:/mnt/path or NAME:/mnt/path:ro")
    return {"name": parts[0], "path": parts[1], "readonly": parts[2:] == ["ro"]}
