"""Explore: try k variants from one state, score each, keep the best.

One call does what a search loop over sandboxes does by hand::

    branch the source once  ->  fork one child per variant  ->  in every child, in
    parallel: the variant's step, then the score step  ->  rank  ->  keep the best
    ``keep`` (running, or branched into snapshots)  ->  kill the rest

The source keeps running; it is paused only for the branch. A variant whose step or
score fails, or is still running at the deadline, has no score and its error; it
never fails the others. Whatever the explore made (children, the branch, kept
snapshots) is taken back when it fails, or when it is cancelled (the client went
away): a branch, a fork or the explore's end (keeping, killing) in progress runs
to its end first, so a source is never left paused and nothing is left half-made.
Every check that needs no VM (names, labels, the daemon's caps) is made before
the source is paused.

Labels: every child, and every snapshot kept, carries :data:`EXPLORE` (the
branch's tag, which names the explore), :data:`PARENT` (the source), and
:data:`VARIANT` (its index); scored ones :data:`SCORE`. A source that was itself
a variant does not pass its variant and score on. Each finished variant is an
``explore_variant`` event on the source; the end is an ``explored`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from forkd import limits
from forkd.controller.models import (
    BranchRequest,
    EvalRequest,
    ExecRequest,
    ExploreRequest,
    ExploreResult,
    ExploreStep,
    SandboxCreate,
    SandboxInfo,
    SnapshotInfo,
)
from forkd.controller.services.admission import AdmissionControl
from forkd.controller.services.branches import BranchService
from forkd.controller.services.events import EventBus
from forkd.controller.services.explore_scores import (
    Outcome,
    StepFailed,
    chosen,
    parse_score,
    ranked,
)
from forkd.controller.services.guest_calls import GuestCalls
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.network import NetworkService
from forkd.controller.services.records import Records
from forkd.controller.services.sandboxes import SandboxService
from forkd.controller.services.snapshots import SnapshotService
from forkd.controller.store import Store
from forkd.controller.store_rows import merged_labels
from forkd.errors import Busy, Conflict, ForkdError

log = logging.getLogger(__name__)

T = TypeVar("T")

EXPLORE = "forkd.explore"
PARENT = "forkd.parent"
VARIANT = "forkd.variant"
SCORE = "forkd.score"

STALE = frozenset({VARIANT, SCORE})  # marks of the search a source was a variant of
# The score is the guest's text: only its end is read, and a line this long is no number.
KEEP_BUSY_TRIES = 40  # a kept child's branch meets the branch cap: retried this often
KEEP_BUSY_WAIT_SECS = 0.25


@dataclass(frozen=True)
class _Ran:
    """What a step did, exec or eval alike."""

    exit_code: int | None
    stdout: str
    result: str | None  # an eval's
    timed_out: bool
    failure: str | None  # why it did not end cleanly: "exited 2: ...", "raised ..."

    def check(self, what: str) -> None:
        """:class:`TimeoutError` or :class:`StepFailed` unless it ended cleanly."""
        if self.timed_out:
            raise TimeoutError
        if self.failure is not None:
            raise StepFailed(f"{what} {self.failure}")


@dataclass
class _Made:
    """What an explore made and has not handed over (the kept children and snapshots
    too, until its answer is built): taken back on failure or cancellation."""

    branch: str | None = None
    children: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)

    def hand_over(self) -> None:
        self.branch = None
        self.children = []
        self.snapshots = []


async def settled(task: asyncio.Future[Any]) -> None:
    """Wait until ``task`` is done, whatever cancels this wait meanwhile."""
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)


async def to_end(work: Awaitable[T]) -> T:
    """``work``'s result. Cancelled meanwhile, ``work`` still runs to its end (a branch
    resumes its source; a fork settles every child; the end of an explore kills its
    losers), and then the cancellation goes on."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await settled(task)
        raise


class ExploreService:
    def __init__(
        self,
        store: Store,
        events: EventBus,
        records: Records,
        vms: LiveVMs,
        admission: AdmissionControl,
        branches: BranchService,
        sandboxes: SandboxService,
        guest: GuestCalls,
        snapshots: SnapshotService,
        network: NetworkService,
    ) -> None:
        self.store = store
        self.events = events
        self.records = records
        self.vms = vms
        self.admission = admission
        self.branches = branches
        self.sandboxes = sandboxes
        self.guest = guest
        self.snapshots = snapshots
        self.network = network  # a variant's own network policy is set on its child
        self.taking_back: set[asyncio.Task[None]] = set()  # awaited when the daemon stops

    async def explore(self, source_id: str, req: ExploreRequest) -> ExploreResult:
        started = time.monotonic()
        tag = self._admitted(source_id, req)
        made = _Made()
        try:
            result = await self._explore(source_id, req, tag, started, made)
        except BaseException:
            undo = asyncio.ensure_future(self._take_back(made))
            self.taking_back.add(undo)
            undo.add_done_callback(self.taking_back.discard)
            await settled(undo)  # a second cancel does not stop it
            raise
        made.hand_over()  # no await since the answer was built: it is the client's now
        return result

    async def drain(self, timeout: float) -> None:
        """Let the explores being taken back finish (the daemon stops)."""
        if self.taking_back:
            await asyncio.wait(set(self.taking_back), timeout=timeout)

    def _admitted(self, source_id: str, req: ExploreRequest) -> str:
        """The explore's tag, once every check that needs no VM passed: nothing is made
        for a request that would fail on its labels, its names or the daemon's caps."""
        row = self.records.sandbox_row(source_id)  # NotFound
        seq = None if req.tag else self.store.next_branch_seq(source_id)
        tag = limits.check_tag(req.tag or f"explore-{source_id}-{seq}")
        names = [tag]
        if req.keep_as == "snapshots":
            names += [limits.check_tag(_kept_tag(tag, i)) for i in range(len(req.variants))]
        taken = [n for n in names if self.store.get_snapshot(n) is not None]
        if taken:
            raise Conflict(f"snapshot {taken[0]!r} exists: give the explore another tag")
        inherited = {k: v for k, v in row.metadata.items() if k not in STALE}
        marks = {EXPLORE: tag, PARENT: source_id, VARIANT: "0", SCORE: "0"}
        merged_labels(inherited, {**(req.metadata or {}), **marks})  # Invalid past the cap
        vm = self.vms.get(source_id)
        if vm is not None:  # room for the children, asked now (held when they fork)
            what = f"exploring {len(req.variants)} variants of {source_id}"
            with self.admission.admit(what, len(req.variants), vm.machine.memory_mib):
                pass
        return tag

    async def _explore(
        self, source_id: str, req: ExploreRequest, tag: str, started: float, made: _Made
    ) -> ExploreResult:
        deadline = started + req.timeout_secs
        snap = await to_end(self._branch(source_id, tag, made))
        forked = time.monotonic()
        labels = {**(req.metadata or {}), EXPLORE: tag, PARENT: source_id}
        fork = SandboxCreate(snapshot_tag=tag, n=len(req.variants), seed=req.seed, metadata=labels)
        children = await to_end(self._fork(fork, made))
        fork_ms = (time.monotonic() - forked) * 1000
        for i, (child, step) in enumerate(zip(children, req.variants, strict=True)):
            self.store.add_sandbox_labels(child.id, {VARIANT: str(i)})
            if step.network is not None:
                await self.network.update(child.id, step.network)
        outcomes = await asyncio.gather(
            *(
                self._variant(Outcome(i, child.id), step, req, source_id, tag, deadline)
                for i, (child, step) in enumerate(zip(children, req.variants, strict=True))
            )
        )
        order = ranked(list(outcomes), req.minimize)
        branch_kept = await to_end(self._finish(order, req, source_id, tag, made))
        return ExploreResult(
            branch=tag,
            pause_ms=snap.pause_ms,
            fork_ms=round(fork_ms, 1),
            duration_ms=round((time.monotonic() - started) * 1000, 1),
            branch_kept=branch_kept,
            results=[o.result() for o in order],
        )

    async def _branch(self, source_id: str, tag: str, made: _Made) -> SnapshotInfo:
        """Branch ``source_id`` as ``tag`` (its own search marks not inherited). The
        explore owns the snapshot once it is registered, also when the branch then
        failed (resuming the source did, say): the tag was free before."""
        req = BranchRequest(tag=tag, metadata={EXPLORE: tag, PARENT: source_id})
        try:
            return await self.branches.branch(source_id, req, drop_labels=STALE)
        finally:
            if self._registered(tag, source_id):
                made.branch = tag

    def _registered(self, tag: str, source_id: str) -> bool:
        """Whether ``tag`` is registered as a branch of ``source_id`` (a tag that was free
        before the branch: the explore's, even when the branch then failed)."""
        found = self.store.get_snapshot(tag)
        return found is not None and found.branched_from == source_id

    async def _fork(self, fork: SandboxCreate, made: _Made) -> list[SandboxInfo]:
        children = await self.sandboxes.create(fork, pool=False)
        made.children = [c.id for c in children]
        return children

    # ------------------------------------------------------------ one variant

    async def _variant(
        self,
        out: Outcome,
        step: ExploreStep,
        req: ExploreRequest,
        source_id: str,
        tag: str,
        deadline: float,
    ) -> Outcome:
        """Run ``step`` then the score in ``out``'s child; never raises but a cancel."""
        began = time.monotonic()
        try:
            left = deadline - began
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                await self._step(out, step, deadline)
                if req.score is not None:
                    score = await self._score(out, req.score, deadline)
                    self.store.add_sandbox_labels(out.sandbox_id, {SCORE: f"{score:.10g}"})
                    out.score = score  # once labelled: a score and an error never both
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
        self.events.publish(
            "explore_variant",
            sandbox_id=source_id,
            explore=tag,
            index=out.index,
            child_id=out.sandbox_id,
            score=out.score,
            exit_code=out.exit_code,
            error=out.error,
        )
        return out

    async def _step(self, out: Outcome, step: ExploreStep, deadline: float) -> None:
        """The variant's own step: recorded in ``out``; :class:`StepFailed` unless it ran
        to a clean end."""
        ran = await self._run(out.sandbox_id, step, deadline)
        out.exit_code = ran.exit_code
        out.stdout_tail = ran.stdout[-limits.EXPLORE_STDOUT_TAIL :]
        ran.check("step")

    async def _score(self, out: Outcome, step: ExploreStep, deadline: float) -> float:
        """The score step's number; what it printed (or returned) is kept in ``out``."""
        ran = await self._run(out.sandbox_id, step, deadline)
        out.score_tail = (ran.result or ran.stdout)[-limits.EXPLORE_STDOUT_TAIL :]
        ran.check("score")
        return parse_score(ran.stdout if step.eval is None else ran.result, "score")

    async def _run(self, sandbox_id: str, step: ExploreStep, deadline: float) -> _Ran:
        """``step`` in the sandbox, as an eval or an exec, with what is left as its timeout."""
        if step.eval is not None:
            ran = await self.guest.eval(sandbox_id, _eval(step.eval, deadline))
            failure = None if ran.error is None else f"raised {_tail(ran.error)}"
            return _Ran(ran.exit_code, ran.stdout, ran.result, ran.timed_out, failure)
        res = await self.guest.exec(sandbox_id, _exec(step, deadline))
        failure = None if res.exit_code == 0 else f"exited {res.exit_code}: {_tail(res.stderr)}"
        return _Ran(res.exit_code, res.stdout, None, res.timed_out, failure)

    # ------------------------------------------------------------ the end

    async def _finish(
        self, order: list[Outcome], req: ExploreRequest, source_id: str, tag: str, made: _Made
    ) -> bool:
        """Keep the best, kill the rest, drop the branch unless a kept child maps it;
        whether it was kept. Run to its end even when cancelled (see :func:`to_end`)."""
        alive = [o for o in order if o.sandbox_id in self.vms]  # none killed meanwhile
        kept = chosen(alive, req.keep, req.score is not None)
        running = await self._keep(kept, req, tag, made)
        await self._kill_all([c for c in made.children if c not in running])
        made.children = running
        if not running:
            await self._drop_snapshot(tag)
            made.branch = None
        self.events.publish(
            "explored",
            sandbox_id=source_id,
            explore=tag,
            kept=[o.snapshot_tag or o.sandbox_id for o in kept if o.kept],
            best=order[0].score if order else None,
        )
        return bool(running)

    async def _keep(
        self, kept: list[Outcome], req: ExploreRequest, tag: str, made: _Made
    ) -> list[str]:
        """Mark the kept; with keep_as snapshots, branch each. The children that run on:
        the kept ones, or those whose branch failed (kept running, its error said)."""
        running: list[str] = []
        for out in kept:
            out.kept = True
            if req.keep_as == "sandboxes":
                running.append(out.sandbox_id)
                continue
            name = _kept_tag(tag, out.index)
            try:
                await self._branch_kept(out, name)
            except ForkdError as exc:
                if self._registered(name, out.sandbox_id):
                    await self._drop_snapshot(name)  # registered, then the branch failed
                out.error = f"kept running: branching it into {name!r} failed: {exc}"
                running.append(out.sandbox_id)
                continue
            made.snapshots.append(name)
            out.snapshot_tag = name
        return running

    async def _branch_kept(self, out: Outcome, name: str) -> None:
        labels = {} if out.score is None else {SCORE: f"{out.score:.10g}"}
        req = BranchRequest(tag=name, metadata=labels)
        for attempt in range(KEEP_BUSY_TRIES):
            try:
                await self.branches.branch(out.sandbox_id, req)
                return
            except Busy:  # the branch cap: other branches finish in a moment
                if attempt == KEEP_BUSY_TRIES - 1:
                    raise
                await asyncio.sleep(KEEP_BUSY_WAIT_SECS)

    async def _take_back(self, made: _Made) -> None:
        """Kill ``made``'s children, delete its snapshots and its branch; each failure is
        logged, none stops the rest."""
        await self._kill_all(made.children)
        for tag in [*made.snapshots, *([made.branch] if made.branch else [])]:
            await self._drop_snapshot(tag)
        made.hand_over()

    async def _kill_all(self, ids: Sequence[str]) -> None:
        results = await asyncio.gather(
            *(self.vms.remove(i, "explore") for i in ids), return_exceptions=True
        )
        for sid, res in zip(ids, results, strict=True):
            if isinstance(res, BaseException):
                log.error("explore: killing child %s failed: %s", sid, res)

    async def _drop_snapshot(self, tag: str) -> None:
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
        args=step.exec,
        timeout_secs=min(_left(deadline), limits.MAX_EXEC_TIMEOUT_SECS),
        cwd=step.cwd,
        env=step.env,
        stdin=step.stdin,
        user=step.user,
    )


def _eval(code: str, deadline: float) -> EvalRequest:
    return EvalRequest(code=code, timeout_s=min(_left(deadline), limits.MAX_EVAL_TIMEOUT_SECS))


def _tail(text: str, chars: int = 300) -> str:
    text = text.strip()
    return text if len(text) <= chars else "..." + text[-chars:]
