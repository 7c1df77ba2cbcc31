"""Diffs: what a sandbox changed, against the snapshot it was forked from, another
snapshot of its image, or another sandbox of its image.

Both sides are manifests of an overlay's upper layer (:mod:`.manifests`): a
sandbox's is read from its agent; a snapshot's from a child forked of it for
the purpose and killed at once, then kept beside the snapshot's files
(``fs-manifests/``), so each snapshot and path costs one such fork, ever. The
changed files only are walked, so a diff costs what the sandbox changed, not
the size of its tree.

``patch`` reads the text of every changed file from both sides (a snapshot's
through a child forked of it, as above; a file the image holds through the
sandbox's own view of its image) and runs GNU ``diff -u`` on it in a process
with a deadline, never on the daemon's own thread: the contents are the
guests', so hostile. ``tar`` streams the added and modified files.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import posixpath
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from forkd import agent_wire as wire
from forkd import limits
from forkd.controller.models import DiffChange, DiffResult, SandboxCreate
from forkd.controller.services.file_transfer import Download, FileTransferService
from forkd.controller.services.guest_calls import GuestCalls
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.manifests import (
    Difference,
    Manifest,
    Stat,
    compare,
    one_sided,
    reader_for,
    stat_of,
)
from forkd.controller.services.records import Records
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.sandboxes import SandboxService
from forkd.controller.services.waking import Waker
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow, SnapshotRow
from forkd.errors import Conflict, ForkdError, GuestError, NotFound
from forkd.vmm.snapshot import files as snapshot_files

PURPOSE = "forkd.purpose"  # the label of a child forked only to read its snapshot
CACHE_DIR = "fs-manifests"
CACHE_VERSION = 2
LOWER_BATCH = wire.MAX_LOWER_PATHS  # paths per fs_lower_stat request (the agent's cap)
DIFF_TIMEOUT_SECS = 10.0  # GNU diff on one file pair; then it is "too costly to show"
_REFUSALS: dict[str, type[ForkdError]] = {"ValueError": Conflict}  # no overlay; old agent

Reader = Callable[[str], Awaitable[bytes | None]]


@dataclass
class _Pair:
    base: Manifest
    target: Manifest
    against: str
    kind: Literal["snapshot", "sandbox"]
    snapshot: SnapshotRow | None  # when against a snapshot
    image: dict[str, Stat | None] = field(default_factory=dict)  # at the one-sided paths

    def differences(self) -> list[Difference]:
        return list(compare(self.base, self.target, self.image))


class DiffService:
    def __init__(
        self,
        store: Store,
        records: Records,
        vms: LiveVMs,
        waker: Waker,
        sandboxes: SandboxService,
        guest: GuestCalls,
        files: FileTransferService,
    ) -> None:
        self.store = store
        self.records = records
        self.vms = vms
        self.waker = waker
        self.sandboxes = sandboxes
        self.guest = guest
        self.files = files
        self._reading: dict[tuple[str, str], asyncio.Lock] = {}

    async def diff(self, sandbox_id: str, path: str, against: str | None) -> DiffResult:
        started = time.monotonic()
        pair = await self._pair(sandbox_id, path, against)
        changes = [_change(d) for d in pair.differences()]
        return DiffResult(
            sandbox_id=sandbox_id,
            against=pair.against,
            against_kind=pair.kind,
            path=pair.target.path,
            changes=changes,
            truncated=pair.base.truncated or pair.target.truncated,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
        )

    async def tar(self, sandbox_id: str, path: str, against: str | None) -> Download:
        """The files added and modified, as a tar stream named by their paths."""
        pair = await self._pair(sandbox_id, path, against)
        paths = [d.path for d in pair.differences() if d.change != "removed" and d.kind != "other"]
        return await self.files.download_paths(sandbox_id, paths)

    async def patch(self, sandbox_id: str, path: str, against: str | None) -> str:
        """A unified diff of the text files changed (others named as differing)."""
        pair = await self._pair(sandbox_id, path, against)
        changed = [d for d in pair.differences() if d.kind == "file"]
        out: list[str] = []
        size = 0
        async with self._old_files(pair, sandbox_id) as read_old:
            for done, d in enumerate(changed):
                if done >= limits.PATCH_MAX_FILES or size >= limits.PATCH_MAX_BYTES:
                    out.append(f"# forkd: {len(changed) - done} more changed files not shown\n")
                    break
                old = b"" if d.change == "added" else await read_old(d.path)
                new = b"" if d.change == "removed" else await self._read(sandbox_id, d.path)
                piece = await unified(d, old, new, pair.target.path)
                out.append(piece)
                size += len(piece)
        if pair.base.truncated or pair.target.truncated:
            out.append("# forkd: more changes than a diff lists: diff a smaller path\n")
        return "".join(out)

    # ------------------------------------------------------------ the two sides

    async def _pair(self, sandbox_id: str, path: str, against: str | None) -> _Pair:
        pair = await self._sides(sandbox_id, _normal(path), against)
        pair.image = await self.image_stats(sandbox_id, one_sided(pair.base, pair.target))
        return pair

    async def _sides(self, sandbox_id: str, path: str, against: str | None) -> _Pair:
        row = self.records.sandbox_row(sandbox_id)
        await self.waker.running(sandbox_id)  # woken, or 409 unless it runs
        against = against or row.snapshot_tag
        other = self.store.get_sandbox(against)
        snap = None if other is not None else self.store.get_snapshot(against)
        if other is not None:
            _same_image(self._image_of(row), self._image_of(other), against)
            base = await self.manifest_of_sandbox(against, path)
        elif snap is not None:
            _same_image(self._image_of(row), snap.image, against)
            base = await self.manifest_of_snapshot(snap, path)
        else:
            raise NotFound(f"no sandbox or snapshot {against!r} to compare with")
        target = await self.manifest_of_sandbox(sandbox_id, path)
        return _Pair(base, target, against, "sandbox" if snap is None else "snapshot", snap)

    def _image_of(self, row: SandboxRow) -> str | None:
        snap = self.store.get_snapshot(row.snapshot_tag)
        return snap.image if snap is not None else None

    async def manifest_of_sandbox(self, sandbox_id: str, path: str) -> Manifest:
        """What the running sandbox changed under ``path``, read from its agent."""
        opened = await self.guest.call(
            sandbox_id,
            lambda vm: vm.guest.fs_manifest_open(path, limits.MAX_DIFF_ENTRIES),
            _REFUSALS,
        )
        # Its shape is checked where it is read (forkd.agent_wire): both are strings.
        transfer_id, lower = opened["transfer_id"], opened["lower"]
        reader = reader_for(opened.get("format"), path, limits.MAX_DIFF_ENTRIES)
        got = 0
        async with contextlib.aclosing(self.files.stream(sandbox_id, transfer_id)) as chunks:
            async for chunk in chunks:
                got += len(chunk)
                if got > limits.MAX_MANIFEST_BYTES:
                    raise GuestError(
                        f"the guest's manifest is over {limits.MAX_MANIFEST_BYTES} bytes"
                    )
                reader.feed(chunk)
        return reader.manifest(lower_root=_normal(lower))

    async def image_stats(self, sandbox_id: str, paths: list[str]) -> dict[str, Stat | None]:
        """What the sandbox's image holds at ``paths``, asked of its agent in batches."""
        found: dict[str, Stat | None] = {}
        for at in range(0, len(paths), LOWER_BATCH):
            batch = paths[at : at + LOWER_BATCH]
            stats = await self.guest.call(sandbox_id, _lower_stat(batch), _REFUSALS)
            if not isinstance(stats, list) or len(stats) != len(batch):
                raise GuestError("the guest agent's answer about its image is malformed")
            for p, raw in zip(batch, stats, strict=True):
                found[p] = None if raw is None else stat_of(raw)
        return found

    async def manifest_of_snapshot(self, snap: SnapshotRow, path: str) -> Manifest:
        """What the snapshot's guest held changed under ``path``: kept beside its files
        once read (by a child forked for it)."""
        cache = _cache_file(snap, path)
        found = _load_cache(cache, snap)
        if found is not None:
            return found
        key = (snap.tag, path)
        lock = self._reading.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                found = _load_cache(cache, snap)
                if found is not None:
                    return found
                async with self._child_of(snap) as child:
                    manifest = await self.manifest_of_sandbox(child, path)
                await asyncio.to_thread(_save_cache, cache, snap, manifest)
        finally:
            if not lock.locked():  # one lock per read in flight, not per path ever read
                self._reading.pop(key, None)
        return manifest

    @contextlib.asynccontextmanager
    async def _child_of(self, snap: SnapshotRow) -> AsyncIterator[str]:
        """A child of ``snap`` forked only to be read, killed after the block."""
        fork = SandboxCreate(snapshot_tag=snap.tag, n=1, metadata={PURPOSE: "diff"})
        (child,) = await self.sandboxes.create(fork, pool=False)
        try:
            yield child.id
        finally:
            await asyncio.shield(self.vms.remove(child.id))

    # ------------------------------------------------------------ file contents

    async def _read(self, sandbox_id: str, path: str) -> bytes | None:
        """Up to the patch's cap and one byte of the file; None when it cannot be read."""
        try:
            data, _ = await self.files.head(sandbox_id, path, limits.PATCH_FILE_MAX_BYTES + 1)
        except ForkdError:  # gone meanwhile, unreadable: said so in the patch
            return None
        return data

    @contextlib.asynccontextmanager
    async def _old_files(self, pair: _Pair, sandbox_id: str) -> AsyncIterator[Reader]:
        """How to read a changed file as the base side held it: from the other sandbox,
        from a child of the snapshot (forked on the first need), or, for a file the
        base took from the image, from the image through the sandbox's own view."""
        async with contextlib.AsyncExitStack() as stack:
            child: list[str] = []

            async def read_old(path: str) -> bytes | None:
                if path not in pair.base.entries:  # the image's file
                    lower = pair.target.lower_root
                    return None if lower is None else await self._read(sandbox_id, lower + path)
                if pair.kind == "sandbox":
                    return await self._read(pair.against, path)
                if not child:
                    assert pair.snapshot is not None
                    child.append(await stack.enter_async_context(self._child_of(pair.snapshot)))
                return await self._read(child[0], path)

            yield read_old


def _lower_stat(batch: list[str]) -> Callable[[SandboxVM], Awaitable[list[Any]]]:
    return lambda vm: vm.guest.fs_lower_stat(batch)


def _normal(path: str) -> str:
    path = posixpath.normpath(limits.check_guest_path(path))
    return "/" if path.startswith("//") else path


def _same_image(mine: str | None, theirs: str | None, against: str) -> None:
    if mine is not None and theirs is not None and mine != theirs:
        raise Conflict(
            f"{against!r} is of image {theirs!r}, this sandbox of {mine!r}: a diff compares "
            "sandboxes and snapshots of one image"
        )


def _change(d: Difference) -> DiffChange:
    return DiffChange(
        path=d.path,
        change=d.change,
        kind=d.kind,
        size=d.size,
        mode=d.mode,
    )


def _cache_file(snap: SnapshotRow, path: str) -> Path:
    name = hashlib.sha256(path.encode()).hexdigest()[:32]
    return Path(snap.dir) / CACHE_DIR / f"{name}.json"


def _load_cache(cache: Path, snap: SnapshotRow) -> Manifest | None:
    """The kept manifest, when it is of this very snapshot (a tag can be replaced)."""
    try:
        data = json.loads(cache.read_text())
        if data.get("version") != CACHE_VERSION:
            return None
        if data.get("snapshot_id") != snapshot_files.load(Path(snap.dir)).meta.id:
            return None
        return Manifest.from_json(data)
    except (OSError, ValueError, KeyError, TypeError, ForkdError):
        return None


def _save_cache(cache: Path, snap: SnapshotRow, manifest: Manifest) -> None:
    cache.parent.mkdir(exist_ok=True)
    snapshot_id = snapshot_files.load(Path(snap.dir)).meta.id
    data = {"version": CACHE_VERSION, "snapshot_id": snapshot_id, **manifest.to_json()}
    staged = cache.with_name(f".{cache.name}.{secrets.token_hex(4)}.partial")
    try:
        staged.write_text(json.dumps(data, separators=(",", ":")))
        os.replace(staged, cache)
    finally:
        staged.unlink(missing_ok=True)


# ------------------------------------------------------------ unified diffs


def _label(side: str, path: str, top: str) -> str:
    """``a/`` or ``b/`` and ``path`` from the directory diffed (``patch -p1`` applies
    it there, as git's patches apply at the top of a checkout)."""
    rel = path.lstrip("/") if top == "/" else posixpath.relpath(path, top)
    name = posixpath.basename(top) if rel == "." else rel  # the path diffed is a file
    return f"{side}/" + name.replace("\n", "\\n").replace("\t", "\\t")


async def unified(d: Difference, old: bytes | None, new: bytes | None, top: str = "/") -> str:
    """One file's part of the patch: its hunks, or one line saying why there are none.
    Its paths are relative to ``top``, the directory diffed."""
    a = "/dev/null" if d.change == "added" else _label("a", d.path, top)
    b = "/dev/null" if d.change == "removed" else _label("b", d.path, top)
    if old is None or new is None:
        return f"# forkd: {d.path!r} changed but could not be read\n"
    cap = limits.PATCH_FILE_MAX_BYTES
    if len(old) > cap or len(new) > cap:
        return f"Files {a} and {b} differ (over {cap} bytes: not shown)\n"
    if not (_text(old) and _text(new)):
        return f"Binary files {a} and {b} differ\n"
    return await _gnu_diff(a, b, old, new)


def _text(data: bytes) -> bool:
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def _gnu_diff(a: str, b: str, old: bytes, new: bytes) -> str:
    """``diff -u`` of the two, in a process killed at its deadline (GNU diff is
    Debian's essential diffutils)."""
    work = Path(tempfile.mkdtemp(prefix="forkd-diff-"))
    try:
        (work / "a").write_bytes(old)
        (work / "b").write_bytes(new)
        proc = await asyncio.create_subprocess_exec(
            shutil.which("diff") or "/usr/bin/diff",
            "-u",
            "--label",
            a,
            "--label",
            b,
            str(work / "a"),
            str(work / "b"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), DIFF_TIMEOUT_SECS)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return f"Files {a} and {b} differ (too costly to show)\n"
        text = out.decode("utf-8", "replace")
        return text if text.endswith("\n") or not text else text + "\n"
    finally:
        shutil.rmtree(work, ignore_errors=True)
