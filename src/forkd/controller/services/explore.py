"""Explore: try k variants from one state, score each, keep the best.

One call does what a search loop over sandboxes does by hand::

    branch the source once  ->  fork one child per variant  ->  in every child, in
    parallel: the variant's step, then the score step  ->  rank  ->  keep the best
    ``keep`` (running, or branched into snapshots)  ->  kill the rest

The source keeps running; it is paused only for the branch. A variant whose step or
score fails, or is still running at the deadline, has no score and its error; it
never fails the others. Whatever the explore made (children, the branch, kept
snapshots) is taken back when it fails, or when it is cancelled (the client went
away): a branch or a fork in progress runs to its end first, so a source is never
left paused and no child is left behind half-made.

Labels: every child, and every snapshot kept, carries :data:`EXPLORE` (the
branch's tag, which names the explore), :data:`PARENT` (the source), and
:data:`VARIANT` (its index); scored ones :data:`SCORE`. Each finished variant is
an ``explore_variant`` event on the source; the end is an ``explored`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from forkd import limits
from forkd.controller.models import (
    BranchRequest,
    EvalRequest,
    ExecRequest,
    ExploreRequest,
    ExploreResult,
    ExploreStep,
    ExploreVariant,
    SandboxCreate,
    SandboxInfo,
    SnapshotInfo,
)
from forkd.controller.services.branches import BranchService
from forkd.controller.services.fleet import Fleet
from forkd.controller.services.sandboxes import SandboxService
from forkd.controller.services.snapshots import SnapshotService
from forkd.errors import ForkdError

log = logging.getLogger(__name__)

T = TypeVar("T")

EXPLORE = "forkd.explore"
PARENT = "forkd.parent"
VARIANT = "forkd.variant"
SCORE = "forkd.score"

_WRAPPED_NUMBER = re.compile(r"[A-Za-z_][\w.]*\(\s*([^()]*?)\s*\)")  # np.float64(2.5)


class StepFailed(Exception):
    """A variant's step or score did not give what it must; the message says why."""


@dataclass
class _Outcome:
    """One variant, as it goes."""

    index: int
    sandbox_id: str
    score: float | None = None
    exit_code: int | None = None
    stdout_tail: str = ""
    error: str | None = None
    kept: bool = False
    snapshot_tag: str | None = None
    duration_ms: float = 0.0

    def result(self) -> ExploreVariant:
        return ExploreVariant(
            index=self.index, sandbox_id=self.sandbox_id, score=self.score,
            exit_code=self.exit_code, stdout_tail=self.stdout_tail, error=self.error,
            kept=self.kept, snapshot_tag=self.snapshot_tag,
            duration_ms=round(self.duration_ms, 1),
        )  # fmt: skip


@dataclass
class _Made:
    """What an explore made and has not handed over: taken back on failure."""

    branch: str | None = None
    children: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)


def parse_score(text: str | None, what: str) -> float:
    """The number ``text`` is: the last non-empty line of an exec's stdout, or an eval's
    result (a repr: ``3``, ``0.5``, ``np.float64(0.5)``). :class:`StepFailed` else."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not lines:
        raise StepFailed(f"{what} gave no number (it printed nothing)")
    last = lines[-1]
    wrapped = _WRAPPED_NUMBER.fullmatch(last)
    try:
        value = float(wrapped.group(1) if wrapped else last)
    except ValueError:
        raise StepFailed(f"{what} gave no number: its last line is {last[:80]!r}") from None
    if not math.isfinite(value):
        raise StepFailed(f"{what} gave {last[:80]!r}: a score is a finite number")
    return value


def ranked(outcomes: list[_Outcome], minimize: bool) -> list[_Outcome]:
    """Best first: scored ones by score (ties by index), then the unscored by index."""
    sign = 1.0 if minimize else -1.0
    return sorted(
        outcomes,
        key=lambda o: (o.score is None, 0.0 if o.score is None else sign * o.score, o.index),
    )


def chosen(order: list[_Outcome], keep: int, scored: bool) -> list[_Outcome]:
    """The ``keep`` best that succeeded (with a score step: those with a score)."""
    good = [o for o in order if (o.score is not None if scored else o.error is None)]
    return good[:keep]


async def run_to_end(work: Awaitable[T], undo: Callable[[T], Awaitable[None]]) -> T:
    """``work``'s result. Cancelled meanwhile, ``work`` still runs to its end (a branch
    resumes its source; a fork settles every child) and ``undo`` takes back what it
    made; then the cancellation goes on."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # it failed: it took itself back
            await undo(await task)
        raise


class ExploreService:
    def __init__(
        self,
        fleet: Fleet,
        branches: BranchService,
        sandboxes: SandboxService,
        snapshots: SnapshotService,
    ) -> None:
        self.fleet = fleet
        self.branches = branches
        self.sandboxes = sandboxes
        self.snapshots = snapshots

    async def explore(self, source_id: str, req: ExploreRequest) -> ExploreResult:
        started = time.monotonic()
        deadline = started + req.timeout_secs
        self.fleet.sandbox_row(source_id)  # NotFound before anything is made
        seq = None if req.tag else self.fleet.store.next_branch_seq(source_id)
        tag = limits.check_tag(req.tag or f"explore-{source_id}-{seq}")
        if req.keep_as == "snapshots":
            limits.check_tag(_kept_tag(tag, len(req.variants) - 1))  # before anything is made
        made = _Made()
        try:
            return await self._explore(source_id, req, tag, started, deadline, made)
        except BaseException:
            await asyncio.shield(self._take_back(made))  # a second cancel does not stop it
            raise

    async def _explore(
        self,
        source_id: str,
        req: ExploreRequest,
        tag: str,
        started: float,
        deadline: float,
        made: _Made,
    ) -> ExploreResult:
        labels = {EXPLORE: tag, PARENT: source_id}
        branch = BranchRequest(tag=tag, metadata=labels)
        snap = await run_to_end(self.branches.branch(source_id, branch), self._drop_snapshot)
        made.branch = tag
        forked = time.monotonic()
        fork = SandboxCreate(snapshot_tag=tag, n=len(req.variants), seed=req.seed,
                             metadata={**(req.metadata or {}), **labels})  # fmt: skip
        children = await run_to_end(self.sandboxes.create(fork), self._kill_all)
        made.children = [c.id for c in children]
        fork_ms = (time.monotonic() - forked) * 1000
        for i, child in enumerate(children):
            self.fleet.store.add_sandbox_labels(child.id, {VARIANT: str(i)})
        outcomes = await asyncio.gather(*(
            self._variant(_Outcome(i, child.id), step, req, source_id, tag, deadline)
            for i, (child, step) in enumerate(zip(children, req.variants, strict=True))
        ))  # fmt: skip
        order = ranked(list(outcomes), req.minimize)
        kept = chosen(order, req.keep, req.score is not None)
        await self._keep(kept, req, tag, made)
        branch_kept = any(o.kept for o in kept) and req.keep_as == "sandboxes"
        await self._take_back(made, keep_branch=branch_kept)
        self.fleet.events.publish(
            "explored", sandbox_id=source_id, explore=tag,
            kept=[o.snapshot_tag or o.sandbox_id for o in kept if o.kept],
            best=order[0].score if order else None,
        )  # fmt: skip
        return ExploreResult(
            branch=tag,
            pause_ms=snap.pause_ms,
            fork_ms=round(fork_ms, 1),
            duration_ms=round((time.monotonic() - started) * 1000, 1),
            branch_kept=branch_kept,
            results=[o.result() for o in order],
        )

    # ------------------------------------------------------------ one variant

    async def _variant(
        self,
        out: _Outcome,
        step: ExploreStep,
        req: ExploreRequest,
        source_id: str,
        tag: str,
        deadline: float,
    ) -> _Outcome:
        """Run ``step`` then the score in ``out``'s child; never raises but a cancel."""
        began = time.monotonic()
        try:
            left = deadline - began
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                await self._step(out, step, deadline)
                if req.score is not None:
                    out.score = await self._score(out.sandbox_id, req.score, deadline)
                    score = f"{out.score:.10g}"
                    self.fleet.store.add_sandbox_labels(out.sandbox_id, {SCORE: score})
        except TimeoutError:
            out.error = f"timed out: the explore's timeout_secs ({req.timeout_secs:g}) passed"
        except StepFailed as exc:
            out.error = str(exc)
        except ForkdError as exc:
            out.error = str(exc)
        except Exception as exc:  # a variant's failure is its own, never the others'
            log.exception("explore %s: variant %d failed", tag, out.index)
            out.error = f"{type(exc).__name__}: {exc}"
        out.duration_ms = (time.monotonic() - began) * 1000
        self.fleet.events.publish(
            "explore_variant", sandbox_id=source_id, explore=tag, index=out.index,
            child_id=out.sandbox_id, score=out.score, exit_code=out.exit_code, error=out.error,
        )  # fmt: skip
        return out

    async def _step(self, out: _Outcome, step: ExploreStep, deadline: float) -> None:
        """The variant's own step: recorded in ``out``; :class:`StepFailed` unless it ran
        to a clean end."""
        if step.eval is not None:
            ran = await self.sandboxes.eval(out.sandbox_id, _eval(step.eval, deadline))
            out.exit_code = ran.exit_code
            out.stdout_tail = ran.stdout[-limits.EXPLORE_STDOUT_TAIL :]
            if ran.timed_out:
                raise TimeoutError
            if ran.error is not None:
                raise StepFailed(f"step raised {_tail(ran.error)}")
            return
        res = await self.sandboxes.exec(out.sandbox_id, _exec(step, deadline))
        out.exit_code = res.exit_code
        out.stdout_tail = res.stdout[-limits.EXPLORE_STDOUT_TAIL :]
        if res.timed_out:
            raise TimeoutError
        if res.exit_code != 0:
            raise StepFailed(f"step exited {res.exit_code}: {_tail(res.stderr)}")

    async def _score(self, sandbox_id: str, step: ExploreStep, deadline: float) -> float:
        if step.eval is not None:
            ran = await self.sandboxes.eval(sandbox_id, _eval(step.eval, deadline))
            if ran.timed_out:
                raise TimeoutError
            if ran.error is not None:
                raise StepFailed(f"score raised {_tail(ran.error)}")
            return parse_score(ran.result, "score")
        res = await self.sandboxes.exec(sandbox_id, _exec(step, deadline))
        if res.timed_out:
            raise TimeoutError
        if res.exit_code != 0:
            raise StepFailed(f"score exited {res.exit_code}: {_tail(res.stderr)}")
        return parse_score(res.stdout, "score")

    # ------------------------------------------------------------ the end

    async def _keep(self, kept: list[_Outcome], req: ExploreRequest, tag: str,
                    made: _Made) -> None:  # fmt: skip
        """Mark the kept; with keep_as snapshots, branch each (a failure is its error)."""
        for out in kept:
            if req.keep_as == "sandboxes":
                made.children.remove(out.sandbox_id)  # handed over: it runs on
                out.kept = True
                continue
            name = _kept_tag(tag, out.index)
            labels = {} if out.score is None else {SCORE: f"{out.score:.10g}"}
            try:
                await run_to_end(
                    self.branches.branch(out.sandbox_id, BranchRequest(tag=name, metadata=labels)),
                    self._drop_snapshot,
                )
            except ForkdError as exc:
                out.error = f"keeping it as snapshot {name!r} failed: {exc}"
                continue
            made.snapshots.append(name)
            out.kept, out.snapshot_tag = True, name
        made.snapshots.clear()  # handed over

    async def _take_back(self, made: _Made, keep_branch: bool = False) -> None:
        """Kill ``made``'s children, delete its snapshots and (unless ``keep_branch``) its
        branch; each failure is logged, none stops the rest."""
        await self._kill_all(made.children)
        made.children.clear()
        for tag in [*made.snapshots, *([made.branch] if made.branch and not keep_branch else [])]:
            await self._drop_snapshot(tag)
        made.snapshots.clear()
        made.branch = None

    async def _kill_all(self, children: Sequence[str | SandboxInfo]) -> None:
        ids = [c if isinstance(c, str) else c.id for c in children]
        results = await asyncio.gather(*(self.fleet.remove(i) for i in ids), return_exceptions=True)
        for sid, res in zip(ids, results, strict=True):
            if isinstance(res, BaseException):
                log.error("explore: killing child %s failed: %s", sid, res)

    async def _drop_snapshot(self, snap: str | SnapshotInfo) -> None:
        tag = snap if isinstance(snap, str) else snap.tag
        try:
            await self.snapshots.delete(tag)
        except Exception as exc:  # labelled forkd.explore: an operator finds it
            log.error("explore: deleting snapshot %s failed: %s", tag, exc)


def _kept_tag(tag: str, index: int) -> str:
    return f"{tag}-v{index}"


def _left(deadline: float) -> float:
    """Seconds to the deadline, for a guest timeout (at least a millisecond)."""
    return max(deadline - time.monotonic(), 0.001)


def _exec(step: ExploreStep, deadline: float) -> ExecRequest:
    assert step.exec is not None
    return ExecRequest(
        args=step.exec, timeout_secs=min(_left(deadline), limits.MAX_EXEC_TIMEOUT_SECS),
        cwd=step.cwd, env=step.env, stdin=step.stdin, user=step.user,
    )  # fmt: skip


def _eval(code: str, deadline: float) -> EvalRequest:
    return EvalRequest(code=code, timeout_s=min(_left(deadline), limits.MAX_EVAL_TIMEOUT_SECS))


def _tail(text: str, chars: int = 300) -> str:
    text = text.strip()
    return text if len(text) <= chars else "..." + text[-chars:]
