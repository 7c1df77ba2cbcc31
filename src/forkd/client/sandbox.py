"""A running sandbox as an object: :class:`Sandbox`, with its ``commands``, ``files``, ``pty``."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Unpack, overload

from forkd.client.commands import Commands
from forkd.client.connection import JSONDict
from forkd.client.controller import KEEP, Controller
from forkd.client.errors import ControllerError
from forkd.client.explore import DiffResult, ExploreOptions, ExploreResult, Step
from forkd.client.files import Files
from forkd.client.pty import Pty
from forkd.client.results import EvalResult
from forkd.client.views import SandboxView

if TYPE_CHECKING:
    from forkd.client.snapshot import Snapshot


class Sandbox(SandboxView):
    """One running sandbox (a forked microVM).

    ``Sandbox(tag)`` forks a new child of snapshot ``tag``;
    ``Sandbox(sandbox_id=...)`` attaches to a running one. Used as a context
    manager it is killed on exit. Without ``controller=`` it makes its own
    :class:`Controller` from the environment (``FORKD_URL``, ``FORKD_TOKEN``).

    Example::

        with Sandbox("py", timeout_secs=600) as sb:
            r = sb.commands.run("python3 -c 'print(6*7)'")
            assert r.stdout == "42\\n"
            sb.files.write("/tmp/data.json", '{"a": 1}')
            print(sb.eval("import json; json.load(open('/tmp/data.json'))").result)
            snap = sb.branch()                  # keep this state for later
            res = sb.explore(["echo 1", "echo 3"], score="cat /dev/null; echo 5")
        kids = snap.fork(2, seed=7)             # two copies of it (seeds 7, 8), after sb is gone
    """

    def __init__(
        self,
        tag: str | None = None,
        *,
        controller: Controller | None = None,
        sandbox_id: str | None = None,
        **spawn_kwargs: Any,
    ) -> None:
        if (tag is None) == (sandbox_id is None):
            raise ValueError("give a snapshot tag to fork from, or sandbox_id= to attach to")
        if sandbox_id is not None and spawn_kwargs:
            raise TypeError(f"spawn options given with sandbox_id: {sorted(spawn_kwargs)}")
        owns = controller is None
        ctl = controller if controller is not None else Controller()
        try:
            if tag is not None:
                info = ctl.spawn_sandboxes(tag, n=1, **spawn_kwargs)[0]
            else:
                assert sandbox_id is not None
                info = ctl.get_sandbox(sandbox_id)
        except BaseException:
            if owns:
                ctl.close()
            raise
        self._setup(ctl, info, owns)

    def _setup(self, controller: Controller, info: JSONDict, owns: bool) -> None:
        self._controller = controller
        self._info = info
        self._owns_controller = owns
        self._killed = False
        self.commands = Commands(self)
        self.files = Files(self)
        self.pty = Pty(self)

    @classmethod
    def _wrap(cls, controller: Controller, info: JSONDict) -> Sandbox:
        """A Sandbox for a SandboxInfo the daemon already answered."""
        sb = cls.__new__(cls)
        sb._setup(controller, info, owns=False)
        return sb

    @classmethod
    def create(cls, tag: str, **kwargs: Any) -> Sandbox:
        """Fork one new sandbox from snapshot ``tag`` (same as ``Sandbox(tag, ...)``)."""
        return cls(tag, **kwargs)

    @classmethod
    def list(
        cls,
        *,
        state: str | None = None,
        snapshot: str | None = None,
        metadata: dict[str, str] | None = None,
        controller: Controller | None = None,
    ) -> list[Sandbox]:
        """The daemon's sandboxes (attached, not owned: leaving them kills none), those
        in ``state``, of ``snapshot`` and labelled with every pair of ``metadata``.

        Example::

            for sb in Sandbox.list(metadata={"run": "42"}, state="running"):
                sb.kill()
        """
        ctl = controller if controller is not None else Controller()
        infos = ctl.list_sandboxes(state=state, snapshot=snapshot, metadata=metadata)

        def matches(info: JSONDict) -> bool:  # checked here too: an older daemon ignores them
            labels = info.get("metadata") or {}
            return (
                state in (None, info.get("state"))
                and snapshot in (None, info.get("snapshot_tag"))
                and all(labels.get(key) == value for key, value in (metadata or {}).items())
            )

        return [cls._wrap(ctl, info) for info in infos if matches(info)]

    @classmethod
    def connect(cls, sandbox_id: str, *, controller: Controller | None = None) -> Sandbox:
        """Attach to a running sandbox (same as ``Sandbox(sandbox_id=...)``).

        Example::

            sb = Sandbox.connect("sb-1a2b3c-0001")
            print(sb.commands.list())
        """
        return cls(sandbox_id=sandbox_id, controller=controller)

    @property
    def controller(self) -> Controller:
        return self._controller

    def refresh(self) -> JSONDict:
        """Fetch the SandboxInfo again."""
        self._info = self._controller.get_sandbox(self.id)
        return self._info

    def update(self, *, evictable: bool | None = None, auto_resume: bool | None = None) -> JSONDict:
        """Whether the daemon may hibernate it when idle under memory pressure
        (``evictable=False`` protects it), and whether a request wakes it when it is
        paused or hibernated; None keeps either."""
        self._info = self._controller.update_sandbox(
            self.id, evictable=evictable, auto_resume=auto_resume
        )
        return self._info

    def network(self) -> JSONDict:
        """What it may reach now: ``allow_out``, ``deny_out``, ``rules``, ``proxied``."""
        return self._controller.sandbox_network(self.id)

    def set_network(
        self,
        allow_out: Sequence[str] | None = None,
        deny_out: Sequence[str] | None = None,
        rules: dict[str, Any] | None = None,
    ) -> JSONDict:
        """Replace what it may reach, at once (E2B's ``network`` shape): the next
        connection is judged by it, open ones it denies are closed."""
        return self._controller.update_sandbox_network(self.id, allow_out, deny_out, rules)

    def egress(self, after: int = 0, limit: int = 100) -> JSONDict:
        """What it reached and was refused through the egress proxy, oldest first:
        ``{"records": [...], "next_after"}``."""
        return self._controller.sandbox_egress(self.id, after, limit)

    def get_metrics(self) -> JSONDict:
        """What the sandbox uses now (E2B's ``get_metrics``): ``cpu``, ``memory``,
        ``disk``, ``volumes``, ``network``, ``processes``, ``wakes``, ``evictions``. It
        does not wake a paused or hibernated sandbox (its guest figures are null)."""
        return self._controller.sandbox_metrics(self.id)

    def ping(self) -> JSONDict:
        """Check the guest agent answers: ``{"pong": true, ...}``."""
        return self._controller.ping_sandbox(self.id)

    def eval(self, code: str, timeout: float | None = None) -> EvalResult:
        """Run Python in the sandbox's persistent interpreter.

        After ``timeout`` seconds (default 60) the code is interrupted and the
        result has ``timed_out``. What it displayed (``display(obj)``, a rich
        last value, matplotlib figures as PNG) is in ``.display``.

        Example::

            sb.eval("import math; r = 2")
            print(sb.eval("math.pi * r ** 2").result)   # '12.566370614359172'
        """
        return EvalResult.from_answer(self._controller.eval_code(self.id, code, timeout))

    def interrupt(self) -> bool:
        """Interrupt the running eval, as Jupyter interrupts its kernel.

        The eval ends with KeyboardInterrupt as its error; the interpreter and
        its names stay. False when no eval was running.
        """
        return bool(self._controller.interrupt_eval(self.id)["interrupted"])

    def set_timeout(self, timeout_s: float | None, idle_timeout_s: Any = KEEP) -> JSONDict:
        """End the sandbox (its ``on_timeout``: kill by default) ``timeout_s`` seconds
        from now, sooner or later than before; None: never. ``idle_timeout_s``, when
        given: after that long with no API call and no process output (None: never)."""
        self._info = self._controller.set_sandbox_timeout(self.id, timeout_s, idle_timeout_s)
        return self._info

    def pause(self, hibernate: bool = False) -> JSONDict:
        """Stop the sandbox's vCPUs, its memory kept: no CPU used until :meth:`resume`,
        or until a command wakes it (unless it was made with ``auto_resume=False``:
        then commands fail with 409). It can still be branched (exactly as paused).

        ``hibernate``: write it to disk and end its QEMU instead, giving its memory
        back; :meth:`resume` restores it, same id, address, files and processes.
        """
        self._info = self._controller.pause_sandbox(self.id, hibernate=hibernate)
        return self._info

    def hibernate(self) -> JSONDict:
        """``pause(hibernate=True)``."""
        return self.pause(hibernate=True)

    def resume(self, timeout_s: float | None = None) -> JSONDict:
        """Run the paused sandbox again (its clock set to the host's), or wake the
        hibernated one; ``timeout_s``: a new timeout from now."""
        self._info = self._controller.resume_sandbox(self.id, timeout_s=timeout_s)
        return self._info

    def branch(
        self,
        tag: str | None = None,
        mode: str | None = None,
        metadata: dict[str, str] | None = None,
        wait: bool = True,
    ) -> Snapshot:
        """Snapshot this sandbox (a running one pauses briefly, then continues; a paused
        one is taken as it is and stays paused). ``mode``: ``"full"``, ``"diff"`` or
        ``"live"``; ``wait=False``: the Snapshot is ``pending`` (see ``Snapshot.wait()``)."""
        from forkd.client.snapshot import Snapshot  # it forks Sandboxes in turn

        info = self._controller.branch_sandbox(
            self.id, tag=tag, mode=mode, metadata=metadata, wait=wait
        )
        return Snapshot(info["tag"], controller=self._controller, info=info)

    @overload
    def diff(
        self, path: str = ..., against: str | None = ..., format: Literal["json"] = ...
    ) -> DiffResult: ...
    @overload
    def diff(self, path: str, against: str | None, format: Literal["patch"]) -> str: ...
    @overload
    def diff(
        self, path: str = ..., against: str | None = ..., *, format: Literal["patch"]
    ) -> str: ...
    @overload
    def diff(self, path: str, against: str | None, format: Literal["tar"]) -> bytes: ...
    @overload
    def diff(
        self, path: str = ..., against: str | None = ..., *, format: Literal["tar"]
    ) -> bytes: ...

    def diff(
        self, path: str = "/", against: str | None = None, format: str = "json"
    ) -> DiffResult | str | bytes:
        """What this sandbox changed under ``path``: against the snapshot it was forked
        from, or ``against`` (a snapshot tag, or another sandbox's id, of the same image).

        ``format="json"`` (default): a :class:`~forkd.client.explore.DiffResult`, its
        ``changes`` (path, ``added``/``modified``/``removed``, kind, size, mode);
        ``"patch"``: a unified diff of the changed text files; ``"tar"``: the added and
        modified files as a tar archive. Only what changed is walked, so a large tree
        costs what changed in it.

        Example::

            print(sb.diff("/work").of("modified"))          # ['/work/app.py']
            print(sb.diff("/work", format="patch"))
            print(sb.diff("/work", against=other.id).changes)
        """
        return self._controller.diff(self.id, path, against, format)

    def explore(
        self,
        variants: Sequence[Step],
        score: Step | None = None,
        **options: Unpack[ExploreOptions],
    ) -> ExploreResult:
        """Try each of ``variants`` in its own copy of this sandbox, score each, keep the
        best ``keep`` copies running (``keep_as="snapshots"``: as snapshots) and kill the
        rest. This sandbox runs on (it pauses once, for the branch).

        A variant or the score is a shell string, an argv list, or a dict
        (``{"eval": code}``, ``{"exec": argv, "env": {...}, "stdin": ...}``). The score
        prints a number on its last line, or an eval returns one; higher is better
        unless ``minimize``. A variant that fails has ``score`` None and its ``error``.
        ``seed``: variant *i*'s child gets ``seed + i`` (see ``Sandbox(seed=)``).

        Example::

            res = sb.explore(
                ["patch -p1 < /work/a.diff", "patch -p1 < /work/b.diff"],
                score="pytest -q 2>&1 | grep -c PASSED",
                keep=1,
            )
            winner = Sandbox(sandbox_id=res.best.sandbox_id)  # it runs on; the rest are gone
            print(res.best.score, winner.diff("/work", format="patch"))
        """
        return self._controller.explore_sandbox(self.id, variants, score, **options)

    def get_url(self, port: int, path: str = "/") -> str:
        """The daemon's proxy URL of guest TCP ``port`` at ``path``; every request to it
        needs the bearer token (``sb.controller``'s client sends it)."""
        return self._controller.port_url(self.id, port, path)

    def preview_url(self, port: int, ttl_s: int | None = None) -> str:
        """A signed URL of guest ``port`` for a browser, no token needed, until ``ttl_s``
        seconds pass (default one hour) or the sandbox dies."""
        return str(self._controller.create_preview_url(self.id, port, ttl_s)["url"])

    def websocket(
        self, port: int, path: str = "/", subprotocols: builtins.list[str] | None = None
    ) -> Any:
        """A context manager: an httpx-ws ``WebSocketSession`` to ``path`` on guest ``port``."""
        return self._controller.port_websocket(self.id, port, path, subprotocols)

    def kill(self) -> None:
        """Kill the sandbox; killing it again (or one already gone) is a no-op."""
        if self._killed:
            return
        try:
            self._controller.kill_sandbox(self.id)
        except ControllerError as exc:
            if exc.status != 404:
                raise
        self._killed = True

    @property
    def killed(self) -> bool:
        return self._killed

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        finally:
            if self._owns_controller:
                self._controller.close()

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, snapshot={self.snapshot_tag!r})"
