"""The HTTP API's JSON routes, written once for the sync and the async client.

Each method of :class:`Routes` builds a :class:`Call`: the request and what to
make of its answer. It never sends one itself. The :func:`route` decorator hands
the call to the client it is read from: the sync :class:`~forkd.client.Controller`
sends it and returns the answer, the async :class:`~forkd.client.AsyncController`
returns an awaitable of it. So both clients speak the same wire format from the
same code, and the type checker knows ``ctl.health()`` is a ``JSONDict`` on one
and an ``Awaitable[JSONDict]`` on the other. (The streaming routes, with bodies
that are iterated, live in their own modules.)
"""

from __future__ import annotations

import base64
import functools
import inspect
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload
from urllib.parse import quote

import httpx

from forkd import limits
from forkd.client.connection import Address, JSONDict, _resolve_token, json_of
from forkd.client.errors import ControllerError
from forkd.client.explore import DiffResult, ExploreResult, Step, step_body

# An eval's answer comes within its timeout plus the agent's grace to stop it
# and the daemon's margin (15 s): the HTTP wait allows a little more.
EVAL_HTTP_MARGIN_SECS = 30.0

KEEP: Any = object()  # an optional setting left as the daemon has it

T = TypeVar("T")
U = TypeVar("U")
P = ParamSpec("P")


def _response(resp: httpx.Response) -> httpx.Response:
    return resp


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request to the daemon and what to make of its answer: ``decode``."""

    method: str
    path: str
    decode: Callable[[httpx.Response], T]
    json_body: Any = None
    params: dict[str, Any] | None = None
    content: bytes | None = None
    headers: dict[str, str] | None = None
    timeout: float | None = None

    def then(self, then: Callable[[T], U]) -> Call[U]:
        """The same request, its decoded answer passed through ``then``."""
        decode = self.decode
        return Call(
            self.method,
            self.path,
            lambda resp: then(decode(resp)),
            self.json_body,
            self.params,
            self.content,
            self.headers,
            self.timeout,
        )


class SyncRunner:
    """A client that sends a :class:`Call` and returns its answer (Controller)."""

    def _run(self, call: Call[T]) -> T:
        raise NotImplementedError


class AsyncRunner:
    """A client whose :class:`Call` s are awaited (AsyncController)."""

    def _run(self, call: Call[T]) -> Awaitable[T]:
        raise NotImplementedError


class _Route(Generic[P, T]):
    """How the type checker sees a route method: read from the sync client it returns
    the answer, from the async one an awaitable of it."""

    def __init__(self, build: Callable[Concatenate[Any, P], Call[T]]) -> None: ...
    @overload
    def __get__(
        self, client: None, owner: type | None = None
    ) -> Callable[Concatenate[Any, P], Any]: ...
    @overload
    def __get__(self, client: SyncRunner, owner: type | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, client: AsyncRunner, owner: type | None = None
    ) -> Callable[P, Awaitable[T]]: ...
    def __get__(self, client: object, owner: type | None = None) -> Any: ...


def _route(build: Callable[..., Call[Any]]) -> Callable[..., Any]:
    """A route method: ``build`` makes its :class:`Call` and the client it is called on
    runs it (its ``_run``: the answer, or an awaitable of it). At run time it is a
    plain function, so ``Controller.health(ctl)``, monkeypatching, ``help()`` and
    ``mock.create_autospec`` work as for any method; ``help()`` shows the answer's type."""

    @functools.wraps(build)
    def method(self: SyncRunner | AsyncRunner, *args: Any, **kwargs: Any) -> Any:
        return self._run(build(self, *args, **kwargs))

    built = inspect.signature(build)
    answer = str(built.return_annotation).removeprefix("Call[").removesuffix("]")
    method.__signature__ = built.replace(return_annotation=answer)  # type: ignore[attr-defined]
    return method


if TYPE_CHECKING:
    route = _Route
else:
    route = _route


def _quote(segment: str) -> str:
    """Percent-encode one URL path segment (``/`` included)."""
    return quote(str(segment), safe="")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _none(_: object) -> None:
    return None


def _content(resp: httpx.Response) -> bytes:
    return resp.content


def _text(resp: httpx.Response) -> str:
    return resp.text


def _written(answer: Any) -> int:
    return int(answer["written"])


def _entries(body: Any) -> Any:
    """A listing's entries (older daemons answered the bare list)."""
    if isinstance(body, dict) and isinstance(body.get("entries"), list):
        return body["entries"]
    return body


class Routes:
    """The JSON routes; see the module. The client supplies the four below."""

    url: str
    timeout: float
    base_url: str
    socket_path: str | None

    def _address(
        self,
        base_url: str | None,
        timeout: float,
        token: str | None,
        token_file: str | os.PathLike[str] | None,
    ) -> tuple[Address, str | None]:
        """Where the daemon is and the token to send it (both clients' constructors)."""
        address = Address.parse(base_url)
        self.url, self.base_url = address.url, address.base_url
        self.socket_path = address.socket_path
        self.timeout = float(timeout)
        return address, _resolve_token(token, token_file)

    @staticmethod
    def _request(method: str, path: str, **kw: Any) -> Call[httpx.Response]:
        """The call whose answer is the response itself."""
        return Call(method, path, _response, **kw)

    @staticmethod
    def _json(method: str, path: str, **kw: Any) -> Call[Any]:
        """The call whose answer is the response's JSON (an error status raises)."""
        return Call(method, path, lambda resp: json_of(resp, method, path), **kw)

    @staticmethod
    def _sb(sandbox_id: str) -> str:
        return f"/v1/sandboxes/{_quote(sandbox_id)}"

    # -- discovery ----------------------------------------------------------

    @route
    def health(self) -> Call[JSONDict]:
        """``GET /healthz`` → ``{"ok": true}`` (needs no token)."""
        return self._json("GET", "/healthz")

    @route
    def version(self) -> Call[JSONDict]:
        """``GET /version`` → ``{"version": "...", "api": "v1"}``."""
        return self._json("GET", "/version")

    # -- snapshots ----------------------------------------------------------

    @route
    def list_snapshots(self, metadata: dict[str, str] | None = None) -> Call[list[JSONDict]]:
        """``GET /v1/snapshots`` → list of SnapshotInfo, those labelled with every pair
        of ``metadata`` only."""
        return self._json("GET", "/v1/snapshots", params=_label_filters(metadata))

    @route
    def snapshot_info(self, tag: str) -> Call[JSONDict]:
        """``GET /v1/snapshots/{tag}/info``: SnapshotInfo plus sizes and lineage
        (``parent_tag``, ``chain_depth``, ``ancestors``, ``dependents``)."""
        return self._json("GET", f"/v1/snapshots/{_quote(tag)}/info")

    @route
    def create_snapshot(
        self,
        /,  # self only by position: **extra takes any keyword
        tag: str,
        image: str | None = None,
        memory_mib: int | None = None,
        vcpus: int | None = None,
        setup: list[str] | str | None = None,
        warmup: str | None = None,
        boot_wait_secs: float | None = None,
        *,
        start: bool | None = None,
        ready_port: int | None = None,
        ready_cmd: list[str] | str | None = None,
        ready_timeout_secs: float | None = None,
        **extra: Any,
    ) -> Call[JSONDict]:
        """``POST /v1/snapshots``: boot a template VM, warm it, snapshot it.

        ``image``: a built image's name (``python`` by default, see
        :meth:`list_images`), or a container image reference, imported first as
        :meth:`import_image` does (``registry/repo:tag``, ``docker-daemon:IMAGE``,
        ``docker-archive:PATH``, ``oci-archive:PATH[:tag]``, ``oci:DIR[:tag]``).
        A container image's Env, WorkingDir and User become the defaults of every
        command in the template and its forks. ``start``: run its Entrypoint+Cmd
        in the background before the snapshot, until ``ready_port`` (a guest TCP
        port) listens or ``ready_cmd`` (an argv, or a str run as ``/bin/sh -c``)
        exits 0, within ``ready_timeout_secs``; every fork then starts with the
        service running and warm.

        Fields left as None are not sent (the daemon's defaults apply); extra
        keyword arguments (e.g. ``kernel=``, ``volumes=``, ``metadata=``) are sent
        as given. Waits at least 30 minutes for the answer: setup commands, and a
        first import of a big image, may be slow.

        Example::

            ctl.create_snapshot("pg", image="registry.example.com/team/postgres:16",
                                start=True, ready_port=5432)
        """
        if isinstance(setup, str):
            setup = [setup]
        if isinstance(ready_cmd, str):
            ready_cmd = ["/bin/sh", "-c", ready_cmd]
        body = _drop_none(
            {
                "tag": tag,
                "image": image,
                "memory_mib": memory_mib,
                "vcpus": vcpus,
                "setup": setup,
                "warmup": warmup,
                "boot_wait_secs": boot_wait_secs,
                "start": start,
                "ready_port": ready_port,
                "ready_cmd": ready_cmd,
                "ready_timeout_secs": ready_timeout_secs,
                **extra,
            }
        )
        return self._json("POST", "/v1/snapshots", json_body=body, timeout=max(self.timeout, 1800))

    @route
    def delete_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> Call[None]:
        """``DELETE /v1/snapshots/{tag}`` (running children keep running). A snapshot that
        diff snapshots are over is a 409 unless ``cascade`` (they are deleted too) or
        ``force`` (they are compacted into full snapshots and kept)."""
        params = {k: "true" for k, v in (("cascade", cascade), ("force", force)) if v}
        return self._request("DELETE", f"/v1/snapshots/{_quote(tag)}", params=params or None).then(
            _none
        )

    @route
    def compact_snapshot(self, tag: str, to: str | None = None) -> Call[JSONDict]:
        """``POST /v1/snapshots/{tag}/compact``: flatten a diff snapshot's chain into a full
        ``memory.bin`` in place → SnapshotInfo (``mode`` ``"full"``). With ``to``: a new
        full snapshot of that tag instead, ``tag`` left as it is → ``to``'s SnapshotInfo."""
        body = {"to": to} if to is not None else None
        return self._json(
            "POST",
            f"/v1/snapshots/{_quote(tag)}/compact",
            json_body=body,
            timeout=max(self.timeout, 600),
        )

    @route
    def snapshot(self, tag: str) -> Call[JSONDict]:
        """``GET /v1/snapshots/{tag}``: the SnapshotInfo without /info's detail."""
        return self._json("GET", f"/v1/snapshots/{_quote(tag)}")

    @route
    def push_snapshot(self, /, tag: str, ref: str, **options: Any) -> Call[JSONDict]:
        """``POST /v1/snapshots/{tag}/push`` to the OCI registry ``ref`` → ``{digest,
        bytes_uploaded, ...}``. Options: ``token``, ``insecure``, ``flatten`` (no delta)."""
        body = _drop_none({"ref": ref, **options})
        path = f"/v1/snapshots/{_quote(tag)}/push"
        return self._json("POST", path, json_body=body, timeout=max(self.timeout, 1800))

    @route
    def pull_snapshot(self, /, ref: str, tag: str | None = None, **options: Any) -> Call[JSONDict]:
        """``POST /v1/snapshots/pull``: fetch ``ref`` as snapshot ``tag`` (default: the name
        it was pushed under) → SnapshotInfo. Options: ``token``, ``insecure``, ``metadata``."""
        body = _drop_none({"ref": ref, "tag": tag, **options})
        return self._json(
            "POST", "/v1/snapshots/pull", json_body=body, timeout=max(self.timeout, 1800)
        )

    # -- volumes ------------------------------------------------------------

    @route
    def create_volume(
        self, name: str, size: str | int = "1G", from_dir: str | os.PathLike[str] | None = None
    ) -> Call[JSONDict]:
        """``POST /v1/volumes``: an ext4 volume; ``from_dir`` (local) is copied into it.

        Example::

            ctl.create_volume("data", "2G", from_dir="./dataset")
            ctl.create_snapshot("py", volumes=[{"name": "data", "path": "/mnt/data"}])
        """
        content = _tar_directory(Path(from_dir)) if from_dir is not None else b""
        return self._json(
            "POST",
            "/v1/volumes",
            params={"name": name, "size": str(size)},
            content=content,
            headers={"Content-Type": "application/x-tar"},
            timeout=max(self.timeout, 600),
        )

    @route
    def list_volumes(self) -> Call[list[JSONDict]]:
        """``GET /v1/volumes``: each with ``size_bytes``, ``allocated_bytes``, ``used_by``."""
        return self._json("GET", "/v1/volumes")

    @route
    def volume_info(self, name: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/volumes/{_quote(name)}")

    @route
    def delete_volume(self, name: str) -> Call[None]:
        """``DELETE /v1/volumes/{name}``; 409 while a snapshot or sandbox uses it."""
        return self._request("DELETE", f"/v1/volumes/{_quote(name)}").then(_none)

    # -- secrets ------------------------------------------------------------

    @route
    def create_secret(self, name: str, value: str, hosts: Sequence[str]) -> Call[JSONDict]:
        """``POST /v1/secrets``: a credential the daemon's egress proxy puts into requests
        bound for ``hosts`` (names, ``*.domain``) in place of ``${secrets.NAME}``; the
        guest holds only the placeholder. Returns its info, never the value.

        Example::

            ctl.create_secret("openai", key, ["api.openai.com"])
            ctl.create_snapshot("agent", env={"OPENAI_API_KEY": "${secrets.openai}"})
        """
        body = {"name": name, "value": value, "hosts": list(hosts)}
        return self._json("POST", "/v1/secrets", json_body=body)

    @route
    def list_secrets(self) -> Call[list[JSONDict]]:
        """``GET /v1/secrets``: names, hosts, ``created_at_unix``, ``last_used_unix``."""
        return self._json("GET", "/v1/secrets")

    @route
    def secret_info(self, name: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/secrets/{_quote(name)}")

    @route
    def update_secret(
        self, name: str, value: str | None = None, hosts: Sequence[str] | None = None
    ) -> Call[JSONDict]:
        """``PUT /v1/secrets/{name}``: rotate the value and/or change the hosts; the next
        request a sandbox sends uses them (no restart)."""
        body = _drop_none({"value": value, "hosts": list(hosts) if hosts is not None else None})
        return self._json("PUT", f"/v1/secrets/{_quote(name)}", json_body=body)

    @route
    def delete_secret(self, name: str, force: bool = False) -> Call[None]:
        """``DELETE /v1/secrets/{name}``; 409 while running sandboxes' network rules name
        it, unless ``force``."""
        params = {"force": "true"} if force else None
        return self._request("DELETE", f"/v1/secrets/{_quote(name)}", params=params).then(_none)

    # -- images -------------------------------------------------------------

    @route
    def import_image(self, ref: str, token: str | None = None) -> Call[JSONDict]:
        """``POST /v1/images``: import a container image (a registry reference,
        ``docker-daemon:IMAGE``, ``docker-archive:PATH``, ``oci-archive:PATH[:tag]``,
        ``oci:DIR[:tag]``); its info with ``bytes_fetched`` and ``bytes_reused``.
        Waits up to an hour: a first import of a big image takes minutes."""
        body = _drop_none({"ref": ref, "token": token})
        return self._json("POST", "/v1/images", json_body=body, timeout=max(self.timeout, 3600))

    @route
    def list_images(self) -> Call[list[JSONDict]]:
        """``GET /v1/images``: recipe and container images, sizes, shared layers, users."""
        return self._json("GET", "/v1/images")

    @route
    def image_info(self, name: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/images/{_quote(name)}")

    @route
    def delete_image(self, name: str) -> Call[None]:
        """``DELETE /v1/images/{name}``; 409 while a snapshot or sandbox uses it. Frees
        the layers no other image needs."""
        return self._request("DELETE", f"/v1/images/{_quote(name)}").then(_none)

    # -- sandboxes ----------------------------------------------------------

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
        ``auto_resume`` (default true): a request to one while it is paused or
        hibernated (exec, files, processes, its ports) resumes it first; false: a 409.
        ``evictable`` (default true): when the host runs short of memory, the daemon
        may hibernate it once idle; false: never.
        ``network`` (``{"allow_out": [...], "deny_out": [...], "rules": {...}}``, E2B's
        shape) is what they may reach, by name (``egress``: the older forms); default:
        the snapshot's.
        ``prewarm``,
        ``live_fork`` and ``hugepages`` are the original forkd's, sent as given and
        without effect here."""
        body = _drop_none(
            {
                "snapshot_tag": snapshot_tag,
                "n": n,
                "memory_limit_mib": memory_limit_mib,
                "timeout_secs": timeout_secs,
                "internet": internet,
                "per_child_netns": per_child_netns,
                "metadata": metadata,
                "on_timeout": on_timeout,
                "timeout_s": timeout_s,
                "idle_timeout_s": idle_timeout_s,
                "node": node,
                "seed": seed,
                "auto_resume": auto_resume,
                "network": network,
                "egress": egress,
                "evictable": evictable,
                "prewarm": prewarm,
                "live_fork": live_fork,
                "hugepages": hugepages,
            }
        )
        return self._json(
            "POST", "/v1/sandboxes", json_body=body, timeout=self.timeout + 2.0 * max(n, 0)
        )

    @route
    def list_sandboxes(
        self,
        state: str | None = None,
        snapshot: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Call[list[JSONDict]]:
        """``GET /v1/sandboxes`` → list of SandboxInfo: those in ``state``, forked from
        ``snapshot`` and labelled with every pair of ``metadata``, when given."""
        params = {**_drop_none({"state": state, "snapshot": snapshot}), **_label_filters(metadata)}
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
        body = _drop_none({"evictable": evictable, "auto_resume": auto_resume})
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
        body = _drop_none(
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
    def kill_sandbox(self, sandbox_id: str) -> Call[None]:
        """``DELETE /v1/sandboxes/{id}``: kill the VM and free its files."""
        return self._request("DELETE", self._sb(sandbox_id)).then(_none)

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
        body = _drop_none({"tag": tag, "mode": mode, "metadata": metadata})
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
        body = _drop_none(
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
            "patch": _text,
            "tar": _content,
        }
        if format not in decode:
            raise ValueError(f"format is json, patch or tar, not {format!r}")
        url = f"{self._sb(sandbox_id)}/diff"
        params = _drop_none(
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
        body = _drop_none(
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
        body = _drop_none({"code": code, "timeout_s": timeout_s})
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

    # -- workspaces (the original forkd's) -----------------------------------

    @route
    def list_workspaces(self) -> Call[list[JSONDict]]:
        """``GET /v1/workspaces`` → list of WorkspaceInfo, by name."""
        return self._json("GET", "/v1/workspaces")

    @route
    def create_workspace(
        self,
        name: str,
        snapshot_tag: str,
        per_child_netns: bool | None = None,
        memory_limit_mib: int | None = None,
    ) -> Call[JSONDict]:
        """``POST /v1/workspaces``: fork one sandbox of ``snapshot_tag`` as workspace
        ``name`` → WorkspaceInfo (``status`` ``"running"``, ``live_sandbox_id``)."""
        body = _drop_none(
            {
                "name": name,
                "snapshot_tag": snapshot_tag,
                "per_child_netns": per_child_netns,
                "memory_limit_mib": memory_limit_mib,
            }
        )
        return self._json("POST", "/v1/workspaces", json_body=body)

    @route
    def get_workspace(self, name: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/workspaces/{_quote(name)}")

    @route
    def delete_workspace(self, name: str) -> Call[None]:
        """``DELETE /v1/workspaces/{name}``: its sandbox is killed, whatever its state."""
        return self._request("DELETE", f"/v1/workspaces/{_quote(name)}").then(_none)

    @route
    def suspend_workspace(self, name: str) -> Call[JSONDict]:
        """Hibernate the workspace's sandbox (``status`` ``"suspended"``)."""
        return self._json(
            "POST",
            f"/v1/workspaces/{_quote(name)}/suspend",
            json_body={},
            timeout=max(self.timeout, 600),
        )

    @route
    def resume_workspace(self, name: str) -> Call[JSONDict]:
        """Wake it (the same sandbox), or fork anew from its source when it is stale."""
        return self._json(
            "POST",
            f"/v1/workspaces/{_quote(name)}/resume",
            json_body={},
            timeout=max(self.timeout, 600),
        )

    # -- files --------------------------------------------------------------

    @route
    def read_file(self, sandbox_id: str, path: str) -> Call[bytes]:
        """``GET /v1/sandboxes/{id}/files?path=`` → the file's bytes."""
        resp = self._request("GET", f"{self._sb(sandbox_id)}/files", params={"path": path})
        return resp.then(_content)

    @route
    def write_file(self, sandbox_id: str, path: str, data: bytes | str) -> Call[None]:
        """``PUT /v1/sandboxes/{id}/files?path=`` with the raw bytes (a str is
        written as UTF-8)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        resp = self._request(
            "PUT",
            f"{self._sb(sandbox_id)}/files",
            params={"path": path},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )
        return resp.then(_none)

    @route
    def list_files(self, sandbox_id: str, path: str) -> Call[list[JSONDict]]:
        """``GET /v1/sandboxes/{id}/files/list?path=`` → entries
        ``{"name", "type", "size", "mode", "mtime"}``."""
        body = self._json("GET", f"{self._sb(sandbox_id)}/files/list", params={"path": path})
        return body.then(_entries)

    @route
    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> Call[None]:
        """``DELETE /v1/sandboxes/{id}/files?path=&recursive=true|false``."""
        resp = self._request(
            "DELETE",
            f"{self._sb(sandbox_id)}/files",
            params={"path": path, "recursive": "true" if recursive else "false"},
        )
        return resp.then(_none)

    # -- processes (their output streams: ProcessRoutes) ----------------------

    def _procs(self, sandbox_id: str, pid: int | None = None) -> str:
        base = f"{self._sb(sandbox_id)}/processes"
        return base if pid is None else f"{base}/{int(pid)}"

    @route
    def start_process(
        self,
        sandbox_id: str,
        cmd: list[str] | str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
        timeout_s: float | None = None,
        user: str | None = None,
    ) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/processes`` → ProcessInfo (``pid``, ``running``, ...).

        A str ``cmd`` runs as ``/bin/sh -c cmd``; ``pty`` is ``(cols, rows)``;
        ``timeout_s`` kills it (exit code 124). It keeps running after this returns.
        """
        body: JSONDict = {
            "cmd": cmd if isinstance(cmd, str) else [str(a) for a in cmd],
            "stdin": stdin,
        }
        for key, value in (("env", env), ("cwd", cwd), ("timeout_s", timeout_s), ("user", user)):
            if value is not None:
                body[key] = value
        if pty is not None:
            body["pty"] = {"cols": pty[0], "rows": pty[1]}
        return self._json("POST", self._procs(sandbox_id), json_body=body)

    @route
    def list_processes(self, sandbox_id: str) -> Call[list[JSONDict]]:
        """``GET /v1/sandboxes/{id}/processes``: running ones and recently exited ones."""
        return self._json("GET", self._procs(sandbox_id))

    @route
    def get_process(self, sandbox_id: str, pid: int) -> Call[JSONDict]:
        """``GET /v1/sandboxes/{id}/processes/{pid}`` → ProcessInfo."""
        return self._json("GET", self._procs(sandbox_id, pid))

    @route
    def send_stdin(
        self, sandbox_id: str, pid: int, data: str | bytes, eof: bool = False
    ) -> Call[int]:
        """``POST .../processes/{pid}/stdin``; the bytes written. ``eof`` closes stdin after."""
        if isinstance(data, bytes):
            body = {"data": base64.b64encode(data).decode(), "encoding": "base64", "eof": eof}
        else:
            body = {"data": data, "eof": eof}
        answer = self._json("POST", f"{self._procs(sandbox_id, pid)}/stdin", json_body=body)
        return answer.then(_written)

    @route
    def signal_process(
        self, sandbox_id: str, pid: int, signal: int | str = "SIGTERM"
    ) -> Call[None]:
        """``POST .../processes/{pid}/signal``: to its whole process group."""
        path = f"{self._procs(sandbox_id, pid)}/signal"
        return self._request("POST", path, json_body={"signal": signal}).then(_none)

    @route
    def resize_process(self, sandbox_id: str, pid: int, cols: int, rows: int) -> Call[None]:
        """``POST .../processes/{pid}/resize``: its terminal's size."""
        path = f"{self._procs(sandbox_id, pid)}/resize"
        return self._request("POST", path, json_body={"cols": cols, "rows": rows}).then(_none)

    # -- guest ports (their WebSockets and tunnels: PortRoutes) -----------------

    def port_url(self, sandbox_id: str, port: int, path: str = "/") -> str:
        """The proxy URL of guest ``port`` at ``path`` (it needs the bearer token)."""
        return f"{self.base_url}{self._sb(sandbox_id)}/ports/{int(port)}/{path.lstrip('/')}"

    @route
    def create_preview_url(
        self, sandbox_id: str, port: int, ttl_s: int | None = None
    ) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/preview-urls`` → ``{url, token, expires_at, port}``."""
        body: JSONDict = {"port": port}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return self._json("POST", f"{self._sb(sandbox_id)}/preview-urls", json_body=body)


def _tar_directory(path: Path) -> bytes:
    """The contents of a local directory as a gzip-compressed tar archive.

    Compressed, more fits in the daemon's 32 MiB body limit; the daemon tells
    gzip from plain tar by its first bytes (and always has).
    """
    import io
    import tarfile

    if not path.is_dir():
        raise ControllerError(0, f"{path} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for child in sorted(path.iterdir()):
            tar.add(child, arcname=child.name)
    return buf.getvalue()


def _label_filters(metadata: dict[str, str] | None) -> dict[str, str]:
    """``metadata`` as the list routes' query parameters: ``metadata.KEY=VALUE``."""
    return {f"metadata.{key}": value for key, value in (metadata or {}).items()}
