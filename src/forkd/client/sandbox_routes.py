"""Sandboxes: fork, list, change, pause and resume, branch, explore and diff, and the
guest's exec, eval and ping."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx

from forkd import limits
from forkd.client.connection import JSONDict, json_of
from forkd.client.explore import DiffResult, ExploreResult, Step, step_body
from forkd.client.route_base import (
    EVAL_HTTP_MARGIN_SECS,
    KEEP,
    Call,
    RouteBase,
    content_of,
    drop_none,
    label_filters,
    no_answer,
    route,
    text_of,
)


class SandboxCalls(RouteBase):
    """The JSON routes of sandboxes (:class:`~forkd.client.routes.Routes`)."""

    @route
    def spawn_sandboxes(
        self,
        snapshot_tag: str,
        n: int = 1,
        memory_limit_mib: int | None = None,
        timeout_secs: float | None = None,
        internet: bool | None = None,
        per_child_netns: bool | None = None,
        metadata: dict[str, str] | None = None,
        on_timeout: str | None = None,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        node: str | None = None,
        seed: int | None = None,
        auto_resume: bool | None = None,
        evictable: bool | None = None,
        prewarm: bool | None = None,
        live_fork: bool | None = None,
        hugepages: bool | None = None,
        network: dict[str, Any] | None = None,
        egress: Any = None,
        on_stop: str | None = None,
        on_stop_timeout_s: float | None = None,
    ) -> Call[list[JSONDict]]:
        """``POST /v1/sandboxes``: fork ``n`` children of a snapshot (all or
        nothing) → list of SandboxInfo. ``timeout_s`` (or ``timeout_secs``) is the sandbox's
        lifetime on the daemon, not an HTTP timeout, and ``on_timeout`` what it
        does then (``"kill"``, ``"pause"``, ``"hibernate"`` or ``"branch"``), also
        after ``idle_timeout_s`` seconds with no API call and no process output;
        ``metadata`` labels them (over the snapshot's labels, which they inherit);
        ``node`` pins them to one node of a ``forkd gateway``; ``seed``: child *i* gets
        ``seed + i``, from which Python's ``random`` is seeded in its warm interpreter
        and in every Python process it starts (``FORKD_SEED``), so the same seed
        replays the same run; ``os.urandom`` stays unique to each child.
        ``auto_resume`` (default true): a request to one paused or hibernated resumes it.
        ``evictable`` (default true): the daemon may hibernate it, idle, short of memory.
        ``network`` (``{"allow_out": [...], "deny_out": [...], "rules": {...}}``, E2B's shape) is
        what they may reach, by name (``egress``: the older forms); default: the snapshot's.
        ``on_stop``: a command each runs before it is stopped (default: the snapshot's).
        ``prewarm``, ``live_fork``, ``hugepages``: the original forkd's, without effect."""
        body = drop_none(
            {
                "snapshot_tag": snapshot_tag,
                "n": n,
                "memory_limit_mib": memory_limit_mib,
                **_lifetime(timeout_secs, timeout_s, on_timeout, idle_timeout_s),
                **_reach(internet, network, egress),
                "per_child_netns": per_child_netns,
                "metadata": metadata,
                "node": node,
                "seed": seed,
                "auto_resume": auto_resume,
                "evictable": evictable,
                **{"on_stop": on_stop, "on_stop_timeout_s": on_stop_timeout_s},
                **_original_flags(prewarm, live_fork, hugepages),
            }
        )
        wait = self.timeout + 2.0 * max(n, 0)
        return self._json("POST", "/v1/sandboxes", json_body=body, timeout=wait)

    @route
    def list_sandboxes(
        self,
        state: str | None = None,
        snapshot: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Call[list[JSONDict]]:
        """``GET /v1/sandboxes`` → list of SandboxInfo: those in ``state``, forked from
        ``snapshot`` and labelled with every pair of ``metadata``, when given."""
        params = {**drop_none({"state": state, "snapshot": snapshot}), **label_filters(metadata)}
        return self._json("GET", "/v1/sandboxes", params=params)

    @route
    def get_sandbox(self, sandbox_id: str) -> Call[JSONDict]:
        """``GET /v1/sandboxes/{id}`` → SandboxInfo."""
        return self._json("GET", self._sb(sandbox_id))

    @route
    def update_sandbox(
        self, sandbox_id: str, *, evictable: bool | None = None, auto_resume: bool | None = None
    ) -> Call[JSONDict]:
        """``PATCH /v1/sandboxes/{id}``: whether reclaim may hibernate it when the host
        runs short of memory (``evictable``) and whether a request wakes it when it is
        paused or hibernated (``auto_resume``); None keeps it → SandboxInfo."""
        body = drop_none({"evictable": evictable, "auto_resume": auto_resume})
        return self._json("PATCH", self._sb(sandbox_id), json_body=body)

    @route
    def sandbox_network(self, sandbox_id: str) -> Call[JSONDict]:
        """``GET /v1/sandboxes/{id}/network``: ``allow_out``, ``deny_out``, ``rules`` now,
        and ``proxied`` (whether the daemon's egress proxy enforces them by name)."""
        return self._json("GET", f"{self._sb(sandbox_id)}/network")

    @route
    def update_sandbox_network(
        self,
        sandbox_id: str,
        allow_out: Sequence[str] | None = None,
        deny_out: Sequence[str] | None = None,
        rules: dict[str, Any] | None = None,
    ) -> Call[JSONDict]:
        """``PATCH /v1/sandboxes/{id}/network``: replace the sandbox's policy (what is not
        given is empty); its next connection is judged by it and open connections it
        denies are closed (``closed``). ``deny_out=["*"]`` cuts it off.

        Example::

            ctl.update_sandbox_network(sid, deny_out=["*"])
        """
        body = drop_none(
            {
                "allow_out": list(allow_out) if allow_out is not None else None,
                "deny_out": list(deny_out) if deny_out is not None else None,
                "rules": rules,
            }
        )
        return self._json("PATCH", f"{self._sb(sandbox_id)}/network", json_body=body)

    @route
    def sandbox_egress(self, sandbox_id: str, after: int = 0, limit: int = 100) -> Call[JSONDict]:
        """``GET /v1/sandboxes/{id}/egress``: what the guest reached and was refused
        through the egress proxy, oldest first → ``{"records": [...], "next_after"}``."""
        params = {"after": after, "limit": limit}
        return self._json("GET", f"{self._sb(sandbox_id)}/egress", params=params)

    @route
    def sandbox_metrics(self, sandbox_id: str) -> Call[JSONDict]:
        """``GET /v1/sandboxes/{id}/metrics`` → what it uses now: ``cpu`` (``seconds``,
        ``percent``, ``count``), ``memory`` (guest and host bytes), ``disk``,
        ``volumes``, ``network`` (``rx_bytes``, ``tx_bytes``), ``processes``,
        ``last_active_at``, ``wakes``, ``evictions``. Asking wakes nothing."""
        return self._json("GET", f"{self._sb(sandbox_id)}/metrics")

    @route
    def list_sandbox_metrics(self, sandbox_ids: list[str] | None = None) -> Call[list[JSONDict]]:
        """``GET /v1/sandboxes/metrics`` → every sandbox's figures (``sandbox_ids``: those
        only): the host's read now, the guest's as last read."""
        params = {} if sandbox_ids is None else {"sandbox_ids": ",".join(sandbox_ids)}
        return self._json("GET", "/v1/sandboxes/metrics", params=params)

    @route
    def kill_sandbox(self, sandbox_id: str, force: bool = False) -> Call[None]:
        """``DELETE /v1/sandboxes/{id}``: kill the VM and free its files (its stop hook
        runs first, unless ``force``)."""
        params = {"force": "true"} if force else None
        return self._request("DELETE", self._sb(sandbox_id), params=params).then(no_answer)

    @route
    def set_sandbox_timeout(
        self, sandbox_id: str, timeout_s: float | None, idle_timeout_s: Any = KEEP
    ) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/timeout``: its timeout ``timeout_s`` from now (None:
        none), and its idle timeout when given (None removes it) → SandboxInfo with
        ``expires_at``."""
        body: JSONDict = {"timeout_s": timeout_s}
        if idle_timeout_s is not KEEP:
            body["idle_timeout_s"] = idle_timeout_s
        return self._json("POST", f"{self._sb(sandbox_id)}/timeout", json_body=body)

    @route
    def pause_sandbox(self, sandbox_id: str, hibernate: bool = False) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/pause``: stop its vCPUs, memory kept; with
        ``hibernate``, write it to disk and end its QEMU → SandboxInfo."""
        body = {"hibernate": True} if hibernate else None
        return self._json("POST", f"{self._sb(sandbox_id)}/pause", json_body=body)

    @route
    def resume_sandbox(self, sandbox_id: str, timeout_s: float | None = None) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/resume``: run it again, clock set, or wake it from
        hibernation; ``timeout_s`` a new timeout from now → SandboxInfo."""
        body = {"timeout_s": timeout_s} if timeout_s is not None else None
        return self._json("POST", f"{self._sb(sandbox_id)}/resume", json_body=body)

    @route
    def branch_sandbox(
        self,
        sandbox_id: str,
        tag: str | None = None,
        mode: str | None = None,
        metadata: dict[str, str] | None = None,
        wait: bool = True,
        diff: bool = False,
        measure_diff: bool = False,
    ) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/branch``: pause, snapshot, resume →
        SnapshotInfo with ``branched_from`` and ``pause_ms``; ``metadata`` labels
        the branch (over the sandbox's labels). ``mode``: ``"full"`` (default),
        ``"diff"`` (only the pages that differ from the sandbox's snapshot) or
        ``"live"`` (taken as full). ``wait=False``: answered at once with ``status``
        ``"writing"`` (``"pending"`` from older daemons); poll :meth:`snapshot` until
        ``"ready"`` or ``"failed"``.
        The original forkd's ``diff=True`` is ``mode="diff"``; ``measure_diff=True``
        takes a full branch and reports what a diff would have stored (``diff_ms``,
        ``diff_physical_bytes``, ``diff_logical_bytes``, as a diff branch does)."""
        body = drop_none({"tag": tag, "mode": mode, "metadata": metadata})
        if diff:
            body["diff"] = True
        if measure_diff:
            body["measure_diff"] = True
        if not wait:
            body["wait"] = False
        return self._json("POST", f"{self._sb(sandbox_id)}/branch", json_body=body)

    @route
    def explore_sandbox(
        self,
        sandbox_id: str,
        variants: Sequence[Step],
        score: Step | None = None,
        keep: int = 1,
        keep_as: str | None = None,
        minimize: bool = False,
        timeout_secs: float | None = None,
        seed: int | None = None,
        tag: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Call[ExploreResult]:
        """``POST /v1/sandboxes/{id}/explore``: branch once, fork a child per variant, run
        each variant then ``score`` in its child, keep the best ``keep`` (``keep_as``
        ``"sandboxes"``, or ``"snapshots"``: branched, then killed), kill the rest →
        :class:`~forkd.client.explore.ExploreResult`, best first (lower first with
        ``minimize``). A step is a shell string, an argv list, or the wire dict
        (``{"eval": code}``, ``{"exec": argv, "env": ..., "stdin": ...}``); the score
        prints a number on its last line (an eval returns one). ``seed``: variant *i*'s
        child gets ``seed + i``. ``timeout_secs`` (default 300) bounds every variant."""
        body = drop_none(
            {
                "variants": [step_body(v) for v in variants],
                "score": None if score is None else step_body(score),
                "keep": keep,
                "keep_as": keep_as,
                "minimize": minimize or None,
                "timeout_secs": timeout_secs,
                "seed": seed,
                "tag": tag,
                "metadata": metadata,
            }
        )
        # The variants' deadline, plus the branch, the fork and keeping: up to
        # one branch per kept child, not under the deadline. A client that stops
        # waiting cancels the explore and loses what it found.
        wait = (timeout_secs or limits.EXPLORE_TIMEOUT_SECS) + 600.0 + 30.0 * keep
        return self._json(
            "POST",
            f"{self._sb(sandbox_id)}/explore",
            json_body=body,
            timeout=max(self.timeout, wait),
        ).then(ExploreResult.from_answer)

    def _diff(self, sandbox_id: str, path: str, against: str | None, format: str) -> Call[Any]:
        decode: dict[str, Callable[[httpx.Response], Any]] = {
            "json": lambda resp: DiffResult.from_answer(json_of(resp, "GET", url)),
            "patch": text_of,
            "tar": content_of,
        }
        if format not in decode:
            raise ValueError(f"format is json, patch or tar, not {format!r}")
        url = f"{self._sb(sandbox_id)}/diff"
        params = drop_none(
            {"path": path, "against": against, "format": None if format == "json" else format}
        )
        call = self._request("GET", url, params=params, timeout=max(self.timeout, 300))
        return call.then(decode[format])

    @route
    def diff_sandbox(
        self, sandbox_id: str, path: str = "/", against: str | None = None
    ) -> Call[DiffResult]:
        """``GET /v1/sandboxes/{id}/diff``: the paths the sandbox added, modified and
        removed under ``path``, against the snapshot it was forked from, or ``against``
        (a snapshot tag or sandbox id of the same image) →
        :class:`~forkd.client.explore.DiffResult`."""
        return self._diff(sandbox_id, path, against, "json")

    @route
    def diff_patch(self, sandbox_id: str, path: str = "/", against: str | None = None) -> Call[str]:
        """The same diff as a unified patch of the changed text files."""
        return self._diff(sandbox_id, path, against, "patch")

    @route
    def diff_tar(self, sandbox_id: str, path: str = "/", against: str | None = None) -> Call[bytes]:
        """The files the sandbox added or modified under ``path``, as a tar archive."""
        return self._diff(sandbox_id, path, against, "tar")

    @route
    def diff(
        self, sandbox_id: str, path: str = "/", against: str | None = None, format: str = "json"
    ) -> Call[DiffResult | str | bytes]:
        """One of the three above by ``format`` (``json``, ``patch`` or ``tar``)."""
        return self._diff(sandbox_id, path, against, format)

    @route
    def exec_command(
        self,
        sandbox_id: str,
        args: list[str],
        timeout_secs: float = 30,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
        user: str | None = None,
    ) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/exec`` → ``{"stdout", "stderr", "exit_code"}``.

        ``timeout_secs`` bounds the command in the guest (exit code 124 when it
        runs out); the HTTP request waits 30 s longer than that. ``user``: run as
        this user (default: the image's USER, else root).
        """
        if isinstance(stdin, bytes):
            stdin = stdin.decode("utf-8")
        body = drop_none(
            {
                "args": list(args),
                "timeout_secs": timeout_secs,
                "cwd": cwd,
                "env": env,
                "stdin": stdin,
                "user": user,
            }
        )
        return self._json(
            "POST",
            f"{self._sb(sandbox_id)}/exec",
            json_body=body,
            timeout=float(timeout_secs) + 30.0,
        )

    @route
    def eval_code(
        self, sandbox_id: str, code: str, timeout_s: float | None = None
    ) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/eval`` → ``{"result", "error", "exit_code", "display",
        ...}``, in the sandbox's persistent warm interpreter. The guest interrupts the
        code after ``timeout_s`` (default: the daemon's, 60 s)."""
        body = drop_none({"code": code, "timeout_s": timeout_s})
        wait = limits.EVAL_TIMEOUT_SECS if timeout_s is None else float(timeout_s)
        return self._json(
            "POST",
            f"{self._sb(sandbox_id)}/eval",
            json_body=body,
            timeout=max(self.timeout, wait + EVAL_HTTP_MARGIN_SECS),
        )

    @route
    def interrupt_eval(self, sandbox_id: str) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/eval/interrupt`` → ``{"interrupted": bool}``:
        KeyboardInterrupt in the running eval (false when none was running)."""
        return self._json("POST", f"{self._sb(sandbox_id)}/eval/interrupt")

    @route
    def ping_sandbox(self, sandbox_id: str) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/ping`` → ``{"pong": true, ...}``."""
        return self._json("POST", f"{self._sb(sandbox_id)}/ping")


def _lifetime(
    timeout_secs: float | None,
    timeout_s: float | None,
    on_timeout: str | None,
    idle_timeout_s: float | None,
) -> JSONDict:
    """A fork request's fields of how long its sandboxes live, and what they do then."""
    return {
        "timeout_secs": timeout_secs,
        "timeout_s": timeout_s,
        "on_timeout": on_timeout,
        "idle_timeout_s": idle_timeout_s,
    }


def _reach(internet: bool | None, network: dict[str, Any] | None, egress: Any) -> JSONDict:
    """A fork request's fields of what its sandboxes may reach."""
    return {"internet": internet, "network": network, "egress": egress}


def _original_flags(
    prewarm: bool | None, live_fork: bool | None, hugepages: bool | None
) -> JSONDict:
    """The original forkd's fork flags, sent as given (they change nothing here)."""
    return {"prewarm": prewarm, "live_fork": live_fork, "hugepages": hugepages}
