"""CLI commands that talk to a running daemon (``forkd serve``) through the SDK.

``forkd.cli`` calls :func:`register` on its top-level app. Every command takes
``--url`` (``$FORKD_URL``), ``--token-file`` (``$FORKD_TOKEN_FILE``) and
``--json``. Errors from the daemon print its message and exit 1; exit 2 when the
daemon cannot be reached.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

if TYPE_CHECKING:
    import httpx

    from forkd.client import Controller

out = Console()
err = Console(stderr=True)

UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="FORKD_URL",
        help="Daemon address: http://HOST:PORT or unix:/path/to.sock "
        "(default: http://127.0.0.1:8889).",
        show_default=False,
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        envvar="FORKD_TOKEN_FILE",
        help="File holding the daemon's bearer token.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


# -- formatting helpers ---------------------------------------------------------


def _s(value: Any) -> str:
    """A table cell: '-' for None, escaped for rich markup."""
    return "-" if value is None else escape(str(value))


def _age(unix: Any, now: float | None = None) -> str:
    if not isinstance(unix, int | float):
        return "-"
    secs = max(0, int((time.time() if now is None else now) - unix))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit} ago"
    return f"{secs}s ago"


def _bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _ms(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.0f} ms"


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def _table(*columns: str) -> Table:
    """A table whose cells wrap instead of being cut short: ids must stay copyable."""
    table = Table()
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def _kv_table(info: dict[str, Any]) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in info.items():
        if key.endswith("_bytes"):
            cell = f"{_bytes(value)} ({value})" if value is not None else "-"
        elif key == "created_at_unix":
            cell = f"{value} ({_age(value)})"
        elif key == "pause_ms":
            cell = _ms(value)
        elif isinstance(value, list | dict):
            cell = escape(json.dumps(value))
        else:
            cell = _s(value)
        table.add_row(escape(key), cell)
    return table


def _sandbox_table(sandboxes: list[dict[str, Any]]) -> Table:
    table = _table("id", "snapshot", "state", "pid", "created", "memory_limit")
    for sb in sandboxes:
        limit = sb.get("memory_limit_mib")
        table.add_row(
            _s(sb.get("id")), _s(sb.get("snapshot_tag")), _s(sb.get("state")),
            _s(sb.get("pid")), _age(sb.get("created_at_unix")),
            f"{limit} MiB" if limit is not None else "-",
        )  # fmt: skip
    return table


def _snapshot_label(info: dict[str, Any]) -> str:
    tag = escape(str(info.get("tag")))
    bits = []
    if info.get("branched_from"):
        bits.append(f"[bold magenta]{tag}[/] branch, paused {_ms(info.get('pause_ms'))}")
    else:
        bits.append(f"[bold cyan]{tag}[/] snapshot")
    if info.get("memory_mib") is not None:
        bits.append(f"{info['memory_mib']} MiB")
    if info.get("image"):
        bits.append(escape(str(info["image"])))
    if info.get("status") not in (None, "ready"):
        bits.append(f"[yellow]{escape(str(info['status']))}[/]")
    return "  ".join(bits)


def _sandbox_label(sb: dict[str, Any]) -> str:
    state = sb.get("state") or "?"
    color = "green" if state == "running" else "yellow"
    bits = [f"[{color}]{escape(str(sb.get('id')))}[/] {escape(str(state))}"]
    if sb.get("pid") is not None:
        bits.append(f"pid {sb['pid']}")
    return "  ".join(bits)


def lineage_forest(
    snapshots: list[dict[str, Any]], sandboxes: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Nest snapshots and sandboxes into their lineage.

    A sandbox hangs under the snapshot it was forked from; a branch hangs under
    the live sandbox it was taken from, or under its parent snapshot when that
    sandbox is gone. Nodes: ``{"kind": "snapshot"|"sandbox"|"missing", "info",
    "children"}``.
    """
    snaps = {s["tag"]: s for s in snapshots if s.get("tag")}
    sbs = {s["id"]: s for s in sandboxes if s.get("id")}
    children: dict[tuple[str, str], list[tuple[str, str]]] = {}
    roots: list[tuple[str, str]] = []
    missing: dict[str, dict[str, Any]] = {}

    def attach(parent: tuple[str, str] | None, node: tuple[str, str]) -> None:
        if parent is None:
            roots.append(node)
        else:
            children.setdefault(parent, []).append(node)

    for tag, info in snaps.items():
        src, parent_tag = info.get("branched_from"), info.get("parent_tag")
        if src and src in sbs:
            attach(("sandbox", src), ("snapshot", tag))
        elif parent_tag and parent_tag in snaps and parent_tag != tag:
            attach(("snapshot", parent_tag), ("snapshot", tag))
        else:
            attach(None, ("snapshot", tag))
    for sid, sb in sbs.items():
        tag = sb.get("snapshot_tag")
        if tag in snaps:
            attach(("snapshot", tag), ("sandbox", sid))
        else:
            key = str(tag)
            if key not in missing:
                missing[key] = {"tag": tag}
                attach(None, ("missing", key))
            attach(("missing", key), ("sandbox", sid))

    def build(node: tuple[str, str], seen: set[tuple[str, str]]) -> dict[str, Any]:
        kind, key = node
        info = snaps[key] if kind == "snapshot" else sbs[key] if kind == "sandbox" else missing[key]
        seen = seen | {node}
        kids = [build(c, seen) for c in children.get(node, []) if c not in seen]
        return {"kind": kind, "info": info, "children": kids}

    forest = [build(r, set()) for r in roots]
    # Anything unreachable from a root (a cycle in bad data) still shows up.
    placed: set[tuple[str, str]] = set()

    def walk(n: dict[str, Any]) -> None:
        info = n["info"]
        placed.add((n["kind"], info.get("tag") if n["kind"] != "sandbox" else info.get("id")))
        for c in n["children"]:
            walk(c)

    for n in forest:
        walk(n)
    for node in [("snapshot", t) for t in snaps] + [("sandbox", i) for i in sbs]:
        if node not in placed:
            forest.append(build(node, set()))
            walk(forest[-1])
    return forest


def _rich_tree(forest: list[dict[str, Any]], title: str = "forkd") -> Tree:
    root = Tree(f"[bold]{escape(title)}[/]")

    def add(parent: Tree, node: dict[str, Any], under: dict[str, Any] | None) -> None:
        info = node["info"]
        if node["kind"] == "snapshot":
            label = _snapshot_label(info)
            src = info.get("branched_from")
            if src and not (
                under and under["kind"] == "sandbox" and under["info"].get("id") == src
            ):
                label += f"  [dim](from {escape(str(src))}, gone)[/]"
        elif node["kind"] == "sandbox":
            label = _sandbox_label(info)
        else:
            label = f"[red]{escape(str(info.get('tag')))}[/] [dim](snapshot deleted)[/]"
        branch = parent.add(label)
        for child in node["children"]:
            add(branch, child, node)

    for node in forest:
        add(root, node, None)
    return root


def _strip_forest(forest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The JSON form of a lineage forest."""
    return [
        {"kind": n["kind"], **n["info"], "children": _strip_forest(n["children"])} for n in forest
    ]


# -- connection and errors -----------------------------------------------------


def _parent_param(ctx: typer.Context | None, name: str) -> Any:
    while ctx is not None:
        ctx = ctx.parent
        if ctx is not None and ctx.params.get(name) not in (None, False):
            return ctx.params[name]
    return None


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Turn a ControllerError into a red message and an exit code."""
    from forkd.client import ControllerError

    try:
        yield
    except ControllerError as exc:
        err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
        raise typer.Exit(2 if exc.status == 0 else 1) from None


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the daemon commands to ``app``.

    Adds the ``snapshot`` group (``create``, ``ls``, ``info``, and
    ``--from-sandbox`` to branch) and ``rmi``, ``fork``, ``branch``, ``tree``,
    ``ps``, ``exec``, ``eval``, ``rm``. ``transport`` (tests only) is handed to
    every :class:`forkd.client.Controller` the commands make.
    """

    def connect(ctx: typer.Context | None, url: str | None, token_file: Path | None) -> Controller:
        from forkd.client import Controller, _read_token_file

        url = url or _parent_param(ctx, "url")
        token_file = token_file or _parent_param(ctx, "token_file")
        token = _read_token_file(token_file) if token_file else None
        return Controller(url, token=token, transport=transport)

    def want_json(ctx: typer.Context | None, as_json: bool) -> bool:
        return bool(as_json or _parent_param(ctx, "as_json"))

    def show_tree(ctl: Controller, as_json: bool) -> None:
        snapshots = ctl.list_snapshots()
        infos = []
        from forkd.client import ControllerError

        for s in snapshots:
            try:
                infos.append({**s, **ctl.snapshot_info(s["tag"])})
            except ControllerError as exc:
                if exc.status != 404:  # deleted meanwhile: keep what the list said
                    raise
                infos.append(s)
        forest = lineage_forest(infos, ctl.list_sandboxes())
        if as_json:
            _print_json(_strip_forest(forest))
        elif not forest:
            err.print("no snapshots or sandboxes yet: run 'forkd snapshot create --tag NAME'")
        else:
            out.print(_rich_tree(forest, title=ctl.url))

    # -- snapshot group ---------------------------------------------------------

    snapshot_app = typer.Typer(
        help="Build, list and inspect snapshots; branch a running sandbox with --from-sandbox.",
        invoke_without_command=True,
        no_args_is_help=False,
    )
    app.add_typer(snapshot_app, name="snapshot")
    register_volumes(app, connect)

    @snapshot_app.callback(invoke_without_command=True)
    def snapshot_main(
        ctx: typer.Context,
        from_sandbox: Annotated[
            str | None,
            typer.Option("--from-sandbox", help="Branch this running sandbox into a snapshot."),
        ] = None,
        tag: Annotated[
            str | None,
            typer.Option("--tag", help="Tag of the branch (default: chosen by the daemon)."),
        ] = None,
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Build, list and inspect snapshots; `--from-sandbox ID` branches a sandbox."""
        if ctx.invoked_subcommand is not None:
            if from_sandbox is not None:
                err.print("[bold red]error:[/] --from-sandbox takes no subcommand")
                raise typer.Exit(2)
            return
        if from_sandbox is None:
            out.print(ctx.get_help())
            raise typer.Exit(0)
        with _errors(), connect(None, url, token_file) as ctl:
            info = ctl.branch_sandbox(from_sandbox, tag=tag)
        if as_json:
            _print_json(info)
            return
        out.print(
            f"branched [green]{escape(from_sandbox)}[/] → [bold magenta]"
            f"{escape(str(info.get('tag')))}[/] (paused {_ms(info.get('pause_ms'))})"
        )

    @snapshot_app.command("create")
    def snapshot_create(
        ctx: typer.Context,
        tag: Annotated[str, typer.Option("--tag", help="Name of the new snapshot.")],
        image: Annotated[
            str | None, typer.Option("--image", help="Guest image (default: python).")
        ] = None,
        memory: Annotated[
            int | None, typer.Option("--memory", help="Guest RAM in MiB.", min=1)
        ] = None,
        vcpus: Annotated[int | None, typer.Option("--vcpus", help="Virtual CPUs.", min=1)] = None,
        setup: Annotated[
            list[str] | None,
            typer.Option("--setup", help="Shell command to run before the snapshot (repeatable)."),
        ] = None,
        warmup: Annotated[
            str | None,
            typer.Option("--warmup", help="Python run in the agent's interpreter, e.g. imports."),
        ] = None,
        boot_wait_secs: Annotated[
            float | None, typer.Option("--boot-wait-secs", help="How long to wait for the boot.")
        ] = None,
        volume: Annotated[
            list[str] | None,
            typer.Option("--volume", help="Attach NAME:/mnt/path[:ro] (repeatable)."),
        ] = None,
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Boot a template VM, run setup and warm-up, snapshot it under TAG."""
        volumes = [_parse_volume(v) for v in volume or []]
        as_json = want_json(ctx, as_json)
        t0 = time.monotonic()
        status = f"building snapshot {escape(tag)}: boot, setup, warm-up, snapshot"
        with _errors(), connect(ctx, url, token_file) as ctl, err.status(status):
            info = ctl.create_snapshot(
                tag, image=image, memory_mib=memory, vcpus=vcpus,
                setup=setup or None, warmup=warmup, boot_wait_secs=boot_wait_secs,
                **({"volumes": volumes} if volumes else {}),
            )  # fmt: skip
        if as_json:
            _print_json(info)
            return
        err.print(f"snapshot {escape(tag)} ready in {time.monotonic() - t0:.1f} s")
        out.print(_kv_table(info))

    @snapshot_app.command("ls")
    def snapshot_ls(
        ctx: typer.Context,
        tree: Annotated[
            bool, typer.Option("--tree", help="Draw the lineage with live sandboxes.")
        ] = False,
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """List snapshots (templates and branches)."""
        as_json = want_json(ctx, as_json)
        with _errors(), connect(ctx, url, token_file) as ctl:
            if tree:
                show_tree(ctl, as_json)
                return
            snapshots = ctl.list_snapshots()
        if as_json:
            _print_json(snapshots)
            return
        table = _table("tag", "branched_from", "memory_mib", "image", "pause_ms", "created")
        for s in snapshots:
            table.add_row(
                _s(s.get("tag")), _s(s.get("branched_from")), _s(s.get("memory_mib")),
                _s(s.get("image")), _ms(s.get("pause_ms")), _age(s.get("created_at_unix")),
            )  # fmt: skip
        out.print(table)
        if not snapshots:
            err.print("no snapshots yet: run 'forkd snapshot create --tag NAME'")

    @snapshot_app.command("info")
    def snapshot_info(
        ctx: typer.Context,
        tag: Annotated[str, typer.Argument(help="Snapshot tag.")],
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Show a snapshot: files, sizes, lineage."""
        as_json = want_json(ctx, as_json)
        with _errors(), connect(ctx, url, token_file) as ctl:
            info = ctl.snapshot_info(tag)
        if as_json:
            _print_json(info)
        else:
            out.print(_kv_table(info))

    # -- top-level commands -----------------------------------------------------

    @app.command("rmi")
    def rmi(
        tags: Annotated[list[str], typer.Argument(help="Snapshot tags to delete.")],
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Delete snapshots (sandboxes forked from them keep running)."""
        with _errors():
            ctl = connect(None, url, token_file)
        _remove_each(ctl, tags, "snapshot", as_json)

    @app.command("rm")
    def rm(
        ids: Annotated[list[str], typer.Argument(help="Sandbox ids to kill.")],
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Kill sandboxes."""
        with _errors():
            ctl = connect(None, url, token_file)
        _remove_each(ctl, ids, "sandbox", as_json)

    @app.command("fork")
    def fork(
        tag: Annotated[str, typer.Option("--tag", help="Snapshot to fork from.")],
        n: Annotated[int, typer.Option("-n", help="How many sandboxes.", min=1, max=1000)] = 1,
        timeout_secs: Annotated[
            float | None,
            typer.Option("--timeout-secs", help="Kill each sandbox after this many seconds."),
        ] = None,
        memory_limit: Annotated[
            int | None, typer.Option("--memory-limit", help="Memory limit per sandbox, MiB.")
        ] = None,
        internet: Annotated[
            bool | None, typer.Option("--internet/--no-internet", help="Network access.")
        ] = None,
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Fork N sandboxes from a snapshot."""
        t0 = time.monotonic()
        status = f"forking {n} sandbox{'es' if n != 1 else ''} from {escape(tag)}"
        with _errors(), connect(None, url, token_file) as ctl, err.status(status):
            sandboxes = ctl.spawn_sandboxes(
                tag, n=n, memory_limit_mib=memory_limit, timeout_secs=timeout_secs,
                internet=internet,
            )  # fmt: skip
        if as_json:
            _print_json(sandboxes)
            return
        out.print(_sandbox_table(sandboxes))
        err.print(f"forked {len(sandboxes)} from {escape(tag)} in {time.monotonic() - t0:.2f} s")

    @app.command("branch")
    def branch(
        from_sandbox: Annotated[
            str, typer.Option("--from-sandbox", help="Running sandbox to branch.")
        ],
        n: Annotated[
            int, typer.Option("-n", help="Sandboxes to fork from the branch.", min=0, max=1000)
        ] = 1,
        tag: Annotated[
            str | None,
            typer.Option("--tag", help="Tag of the branch (default: chosen by the daemon)."),
        ] = None,
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Branch a running sandbox, then fork N sandboxes from the branch."""
        with _errors(), connect(None, url, token_file) as ctl:
            with err.status(f"branching {escape(from_sandbox)}"):
                info = ctl.branch_sandbox(from_sandbox, tag=tag)
            kids: list[dict[str, Any]] = []
            if n > 0:
                with err.status(f"forking {n} from {escape(str(info['tag']))}"):
                    kids = ctl.spawn_sandboxes(info["tag"], n=n)
        if as_json:
            _print_json({"branch": info, "sandboxes": kids})
            return
        tree = Tree(f"[green]{escape(from_sandbox)}[/] [dim](source)[/]")
        node = tree.add(_snapshot_label(info))
        for kid in kids:
            node.add(_sandbox_label(kid))
        out.print(tree)

    @app.command("tree")
    def tree(
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Draw snapshots, branches and live sandboxes as a lineage tree."""
        with _errors(), connect(None, url, token_file) as ctl:
            show_tree(ctl, as_json)

    @app.command("ps")
    def ps(
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """List sandboxes."""
        with _errors(), connect(None, url, token_file) as ctl:
            sandboxes = ctl.list_sandboxes()
        if as_json:
            _print_json(sandboxes)
            return
        out.print(_sandbox_table(sandboxes))
        if not sandboxes:
            err.print("no sandboxes: run 'forkd fork --tag TAG'")

    @app.command("exec")
    def exec_(
        sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
        cmd: Annotated[
            list[str], typer.Argument(metavar="-- CMD...", help="Program and its arguments.")
        ],
        timeout: Annotated[
            float, typer.Option("--timeout", help="Kill the command after this many seconds.")
        ] = 30,
        cwd: Annotated[str | None, typer.Option("--cwd", help="Working directory.")] = None,
        env: Annotated[
            list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE (repeatable).")
        ] = None,
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Run a command in a sandbox; exits with the command's exit code (124: timed out)."""
        env_map: dict[str, str] | None = None
        if env:
            env_map = {}
            for item in env:
                key, sep, value = item.partition("=")
                if not sep or not key:
                    err.print(f"[bold red]error:[/] --env wants KEY=VALUE, not {escape(item)!r}")
                    raise typer.Exit(2)
                env_map[key] = value
        with _errors(), connect(None, url, token_file) as ctl:
            result = ctl.exec_command(
                sandbox_id, list(cmd), timeout_secs=timeout, cwd=cwd, env=env_map
            )
        from forkd.client import exit_code_of

        code = exit_code_of(result)
        code = code if 0 <= code <= 255 else 1
        if as_json:
            _print_json(result)
        else:
            sys.stdout.write(result.get("stdout") or "")
            sys.stdout.flush()
            sys.stderr.write(result.get("stderr") or "")
            sys.stderr.flush()
        raise typer.Exit(code)

    @app.command("eval")
    def eval_(
        sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
        code: Annotated[str, typer.Argument(help="Python; the repr of a final expression prints.")],
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Evaluate Python in a sandbox's persistent interpreter."""
        with _errors(), connect(None, url, token_file) as ctl:
            result = ctl.eval_code(sandbox_id, code)
        failed = result.get("error") is not None or int(result.get("exit_code") or 0) != 0
        if as_json:
            _print_json(result)
            raise typer.Exit(1 if failed else 0)
        if result.get("stdout"):
            sys.stdout.write(result["stdout"])
        if result.get("stderr"):
            sys.stderr.write(result["stderr"])
        if failed:
            sys.stdout.flush()
            error = result.get("error") or f"exit code {result.get('exit_code')}"
            sys.stderr.write(str(error).rstrip("\n") + "\n")
            sys.stderr.flush()
            raise typer.Exit(1)
        if result.get("result") is not None:
            sys.stdout.write(str(result["result"]) + "\n")
        sys.stdout.flush()


def _remove_each(ctl: Controller, names: list[str], what: str, as_json: bool) -> None:
    """Delete snapshots or kill sandboxes one by one; report each, exit 1 if any failed."""
    from forkd.client import ControllerError

    done: list[str] = []
    failed: dict[str, str] = {}
    with ctl:
        for name in names:
            try:
                if what == "snapshot":
                    ctl.delete_snapshot(name)
                else:
                    ctl.kill_sandbox(name)
            except ControllerError as exc:
                if exc.status == 0:  # unreachable: the rest would fail the same way
                    err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
                    raise typer.Exit(2) from None
                failed[name] = exc.message
                if not as_json:
                    err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
                continue
            done.append(name)
            if not as_json:
                out.print(f"{'deleted' if what == 'snapshot' else 'killed'} {escape(name)}")
    if as_json:
        _print_json({"removed": done, "failed": failed})
    if failed:
        raise typer.Exit(1)


def _parse_volume(text: str) -> dict[str, object]:
    """``NAME:/mnt/path[:ro]`` → the API's volume attachment."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].startswith("/") or parts[2:] not in ([], ["ro"]):
        raise typer.BadParameter(f"{text!r}: use NAME:/mnt/path or NAME:/mnt/path:ro")
    return {"name": parts[0], "path": parts[1], "readonly": parts[2:] == ["ro"]}


def register_volumes(app: typer.Typer, connect: Any) -> None:
    """``forkd volume create|ls|rm``; ``connect`` makes the register's Controller."""
    volume_app = typer.Typer(
        help="Persistent volumes that fork copy-on-write.", no_args_is_help=True
    )
    app.add_typer(volume_app, name="volume")

    @volume_app.command("create")
    def volume_create(
        name: Annotated[str, typer.Argument(help="Volume name.")],
        size: Annotated[str, typer.Option("--size", help="e.g. 512M, 1G.")] = "1G",
        from_dir: Annotated[
            Path | None, typer.Option("--from", help="Copy this local directory in.")
        ] = None,
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Create an ext4 volume (empty, or a copy of a local directory)."""
        with _errors(), connect(None, url, token_file) as ctl:
            info = ctl.create_volume(name, size, from_dir=from_dir)
        if as_json:
            _print_json(info)
        else:
            out.print(_kv_table(info))

    @volume_app.command("ls")
    def volume_ls(
        url: UrlOpt = None, token_file: TokenFileOpt = None, as_json: JsonOpt = False
    ) -> None:
        """List volumes with their size, disk use and users."""
        with _errors(), connect(None, url, token_file) as ctl:
            vols = ctl.list_volumes()
        if as_json:
            _print_json(vols)
            return
        table = Table("name", "size", "on disk", "layers", "used by")
        for v in vols:
            table.add_row(
                v["name"], f"{v['size_bytes'] >> 20} MiB", f"{v['allocated_bytes'] >> 20} MiB",
                str(v.get("layers", 0)), ", ".join(v.get("used_by") or []),
            )  # fmt: skip
        out.print(table)

    @volume_app.command("rm")
    def volume_rm(
        names: Annotated[list[str], typer.Argument(help="Volumes to delete.")],
        url: UrlOpt = None,
        token_file: TokenFileOpt = None,
    ) -> None:
        """Delete volumes (refused while a snapshot or sandbox uses one)."""
        with _errors(), connect(None, url, token_file) as ctl:
            for name in names:
                ctl.delete_volume(name)
                out.print(f"removed volume {escape(name)}")
