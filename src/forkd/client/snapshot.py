"""A snapshot on the daemon as an object: :class:`Snapshot`, to fork sandboxes from."""

from __future__ import annotations

import time
from typing import Any

from forkd.client.connection import JSONDict
from forkd.client.controller import Controller
from forkd.client.sandbox import Sandbox
from forkd.client.views import WRITING, SnapshotView


class Snapshot(SnapshotView):
    """A snapshot on the daemon: a template or a branch of a sandbox.

    Example::

        snap = Snapshot.create("py", memory_mib=512, setup=["pip install numpy"],
                               warmup="import numpy")
        kids = snap.fork(10, timeout_secs=300)
        branch = kids[0].branch()
        print(branch.branched_from, branch.pause_ms)   # 'sb-67a1b3-0001' 212
        grandkids = branch.fork(3)
    """

    def __init__(
        self,
        tag: str,
        *,
        controller: Controller | None = None,
        info: JSONDict | None = None,
    ) -> None:
        self.tag = tag
        self._controller = controller if controller is not None else Controller()
        self._info = info

    @classmethod
    def create(
        cls,
        tag: str,
        controller: Controller | None = None,
        *,
        image: str | None = None,
        start: bool | None = None,
        ready_port: int | None = None,
        ready_cmd: list[str] | str | None = None,
        ready_timeout_secs: float | None = None,
        **create_kwargs: Any,
    ) -> Snapshot:
        """Build a template snapshot (``POST /v1/snapshots``).

        ``image``: a built image's name, or a container image reference (imported
        first); ``start``: run the image's Entrypoint+Cmd before the snapshot, until
        ``ready_port`` listens or ``ready_cmd`` exits 0 (within
        ``ready_timeout_secs``), so every fork starts with it running. Other keyword
        arguments (``memory_mib``, ``setup``, ``warmup``, ``volumes``, ...) as
        :meth:`Controller.create_snapshot`.

        Example::

            pg = Snapshot.create("pg", image="registry.example.com/team/postgres:16",
                                 start=True, ready_port=5432)
            dbs = pg.fork(10)        # ten running databases, each its own copy
        """
        ctl = controller if controller is not None else Controller()
        info = ctl.create_snapshot(
            tag,
            image=image,
            start=start,
            ready_port=ready_port,
            ready_cmd=ready_cmd,
            ready_timeout_secs=ready_timeout_secs,
            **create_kwargs,
        )
        return cls(info.get("tag", tag), controller=ctl, info=info)

    @property
    def controller(self) -> Controller:
        return self._controller

    @property
    def info(self) -> JSONDict:
        """The SnapshotInfo (fetched from the daemon on first use)."""
        if self._info is None:
            self.refresh()
        assert self._info is not None
        return self._info

    def refresh(self) -> JSONDict:
        """Fetch ``GET /v1/snapshots/{tag}/info`` again."""
        self._info = self._controller.snapshot_info(self.tag)
        return self._info

    def fork(self, n: int = 1, **spawn_kwargs: Any) -> list[Sandbox]:
        """Fork ``n`` sandboxes from this snapshot (all or nothing); keyword
        arguments as :meth:`Controller.spawn_sandboxes`. ``seed=S``: child *i*'s Python
        ``random`` (warm interpreter and new processes, ``FORKD_SEED``) is seeded with
        ``S + i``, so forking again with the same seed replays the same run."""
        infos = self._controller.spawn_sandboxes(self.tag, n=n, **spawn_kwargs)
        return [Sandbox._wrap(self._controller, info) for info in infos]

    def wait(self, timeout: float = 600.0, interval: float = 0.2) -> Snapshot:
        """Poll until the snapshot is no longer ``pending``; :class:`TimeoutError` after
        ``timeout`` seconds. Returns itself (check :attr:`status`)."""
        deadline = time.monotonic() + timeout
        while True:
            self._info = self._controller.snapshot(self.tag)
            if self.status not in WRITING:
                return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"snapshot {self.tag!r} still pending after {timeout:g} s")
            time.sleep(interval)

    def compact(self) -> JSONDict:
        """Flatten this diff snapshot into a full one in place (``POST .../compact``)."""
        self._info = self._controller.compact_snapshot(self.tag)
        return self._info

    def push(self, ref: str, **options: Any) -> JSONDict:
        """Send this snapshot to the OCI registry ``ref`` (``registry/repository:tag``);
        options as :meth:`Controller.push_snapshot`. Returns the digest and byte counts."""
        return self._controller.push_snapshot(self.tag, ref, **options)

    @classmethod
    def pull(
        cls,
        ref: str,
        tag: str | None = None,
        controller: Controller | None = None,
        **options: Any,
    ) -> Snapshot:
        """Fetch the snapshot ``ref`` names from its registry onto the daemon, as ``tag``
        (default: the name it was pushed under); 409 if this host cannot restore it."""
        ctl = controller if controller is not None else Controller()
        info = ctl.pull_snapshot(ref, tag, **options)
        return cls(info["tag"], controller=ctl, info=info)

    def delete(self, cascade: bool = False, force: bool = False) -> None:
        """Delete the snapshot (sandboxes forked from it keep running); ``cascade`` and
        ``force`` as :meth:`Controller.delete_snapshot`."""
        self._controller.delete_snapshot(self.tag, cascade=cascade, force=force)

    def __repr__(self) -> str:
        return f"Snapshot({self.tag!r})"
