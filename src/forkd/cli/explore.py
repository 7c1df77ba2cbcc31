"""``forkd explore``: try variants of a sandbox's next step, scored, with a live table.

The explore is one request, answered when every variant is scored. Meanwhile
the daemon publishes an ``explore_variant`` event on the source as each one
finishes, so a second connection to ``/v1/events`` fills the table row by row
(on a terminal; ``--json`` prints only the answer).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

from forkd.cli import render
from forkd.cli.event_watch import watching
from forkd.cli.failures import daemon_errors
from forkd.cli.labels import LabelOpt, parse_labels
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err, out, shown

if TYPE_CHECKING:
    import httpx

    from forkd.client.explore import ExploreResult


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add ``explore`` to ``app``; ``transport`` is for tests."""
    app.command("explore")(with_connection(explore, transport=transport))


def steps(variants: list[str], as_eval: bool) -> list[dict[str, Any]]:
    """The variants as the API takes them: shell commands, or Python code with --eval."""
    return [{"eval": v} if as_eval else {"exec": ["sh", "-c", v]} for v in variants]


SourceArg = Annotated[str, typer.Argument(metavar="ID", help="The sandbox to explore from.")]
VariantOpt = Annotated[
    list[str],
    typer.Option("--variant", "-v", help="A variant's step: a shell command (repeat it)."),
]
ScoreOpt = Annotated[
    str | None,
    typer.Option("--score", help="Shell command printing a number on its last line."),
]
ScoreEvalOpt = Annotated[
    str | None,
    typer.Option("--score-eval", help="Python code in each child whose value is the score."),
]
AsEvalOpt = Annotated[
    bool, typer.Option("--eval", help="The variants are Python code, not shell commands.")
]
KeepOpt = Annotated[int, typer.Option("--keep", min=0, help="Children kept, best first.")]
KeepAsOpt = Annotated[
    str, typer.Option("--keep-as", help="sandboxes, or snapshots (branched, then killed).")
]
MinimizeOpt = Annotated[bool, typer.Option("--minimize", help="Lower scores are better.")]
TimeoutOpt = Annotated[
    float | None, typer.Option("--timeout", help="Seconds for the whole explore (300).")
]
SeedOpt = Annotated[
    int | None, typer.Option("--seed", min=0, help="Variant i's child gets seed + i.")
]
BranchTagOpt = Annotated[
    str | None, typer.Option("--tag", help="The branch's tag (names the explore).")
]


def explore(
    conn: Connection,
    sandbox_id: SourceArg,
    variant: VariantOpt,
    score: ScoreOpt = None,
    score_eval: ScoreEvalOpt = None,
    as_eval: AsEvalOpt = False,
    keep: KeepOpt = 1,
    keep_as: KeepAsOpt = "sandboxes",
    minimize: MinimizeOpt = False,
    timeout: TimeoutOpt = None,
    seed: SeedOpt = None,
    tag: BranchTagOpt = None,
    label: LabelOpt = None,
) -> None:
    """Branch a sandbox once, run each variant in its own fork, score them, keep the best."""
    score_step = _score_step(score, score_eval)
    tag = tag or f"explore-{sandbox_id}-{secrets.token_hex(3)}"
    labels = parse_labels(label)
    with daemon_errors(), conn.controller() as ctl, _live_table(conn, sandbox_id, tag, variant):
        res = ctl.explore_sandbox(
            sandbox_id,
            steps(variant, as_eval),
            score_step,
            keep=keep,
            keep_as=keep_as,
            minimize=minimize,
            timeout_secs=timeout,
            seed=seed,
            tag=tag,
            metadata=labels or None,
        )
    if conn.as_json:
        render.print_json(res.raw)
        return
    out.print(result_table(res, variant))
    pause = "-" if res.pause_ms is None else f"{res.pause_ms} ms"
    err.print(
        f"explored {len(variant)} variants of {shown(sandbox_id)} in "
        f"{res.duration_ms / 1000:.2f} s (branch {shown(res.branch)}: paused {pause}, "
        f"forked in {res.fork_ms:.0f} ms)"
    )


def _score_step(score: str | None, score_eval: str | None) -> dict[str, Any] | None:
    """How each child is scored: --score (a shell command) or --score-eval (Python)."""
    if score is not None and score_eval is not None:
        raise typer.BadParameter("give --score or --score-eval, not both")
    if score is not None:
        return {"exec": ["sh", "-c", score]}
    if score_eval is not None:
        return {"eval": score_eval}
    return None


def result_table(res: ExploreResult, variants: list[str]) -> Table:
    """The answer, best first."""
    table = Table(box=None, header_style="bold")
    for col in ("#", "variant", "score", "exit", "child", "kept", "error"):
        table.add_column(col)
    for r in res.results:
        kept = (r.snapshot_tag or "yes") if r.kept else ""
        table.add_row(
            str(r.index),
            shown(_short(variants[r.index])),
            _score(r.score),
            "" if r.exit_code is None else str(r.exit_code),
            shown(r.sandbox_id or ""),
            shown(kept),
            shown(_short(r.error or "", 60)),
        )
    return table


@contextlib.contextmanager
def _live_table(conn: Connection, source: str, tag: str, variants: list[str]) -> Iterator[None]:
    """While the request runs, a table of the variants filled as their events come."""
    if conn.as_json or not err.is_terminal:
        yield
        return
    rows: dict[int, dict[str, Any]] = {}
    started = time.monotonic()

    def draw() -> Table:
        table = Table(title=f"exploring {shown(source)}", box=None, header_style="bold")
        for col in ("#", "variant", "score", "error"):
            table.add_column(col)
        for i, text in enumerate(variants):
            row = rows.get(i)
            if row is None:
                status = f"[dim]running {time.monotonic() - started:.0f} s[/]"
                table.add_row(str(i), shown(_short(text)), status, "")
                continue
            error = shown(_short(row.get("error") or "", 60))
            table.add_row(str(i), shown(_short(text)), _score(row.get("score")), error)
        return table

    def record(event: dict[str, Any]) -> None:
        if event.get("explore") == tag:
            rows[int(event["index"])] = dict(event)

    live = Live(draw(), console=err, transient=True, refresh_per_second=4, get_renderable=draw)
    with live, watching(conn, "explore_variant", record, source):
        yield


def _score(score: float | None) -> str:
    return "[red]-[/]" if score is None else f"{score:g}"


def _short(text: str, chars: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= chars else text[: chars - 1] + "…"
