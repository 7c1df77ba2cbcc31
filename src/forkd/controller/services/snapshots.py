"""Snapshots: build a template, describe, list, compact and delete what the registry holds.

A diff snapshot (a branch with mode diff) depends on its base (``base_tag``):
the base cannot be deleted while a diff over it exists, unless the delete
cascades (the dependents go first, deepest first) or is forced (the
dependents are compacted into full snapshots first, then only it goes).
``parent_tag`` is lineage only and never blocks a delete.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from forkd import limits, tracing
from forkd.controller.http_errors import hide_host_paths
from forkd.controller.metrics import Metrics
from forkd.controller.models import SnapshotCreate, SnapshotInfo
from forkd.controller.services import template_start
from forkd.controller.services.admission import AdmissionControl
from forkd.controller.services.disk_room import require_room
from forkd.controller.services.events import EventBus
from forkd.controller.services.holds import Holds
from forkd.controller.services.images import ImageService
from forkd.controller.services.launcher import Launcher
from forkd.controller.services.records import Records
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.stop_hooks import StopHook, StopHooks
from forkd.controller.services.template_start import TemplateSetupFailed
from forkd.controller.services.volumes import VolumeService
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SnapshotRow, labelled, now, walk_snapshots
from forkd.egress.ca import EgressCA
from forkd.errors import (
    AgentError,
    Conflict,
    ImageError,
    Invalid,
    SnapshotError,
    StorageFull,
    VMError,
)
from forkd.guest import image as images
from forkd.states import SnapshotMode, SnapshotStatus
from forkd.vmm.jail import egress
from forkd.vmm.pool import ForkPool
from forkd.vmm.snapshot import compact as snapshot_compact
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory_diff
from forkd.vmm.snapshot.files import SnapshotFiles, SnapshotLabels


def snapshot_row(
    tag: str,
    files: SnapshotFiles,
    created_at_unix: int | None = None,
    metadata: dict[str, str] | None = None,
) -> SnapshotRow:
    """The registry row of the snapshot whose files are ``files``, labelled ``metadata``."""
    meta = files.meta
    return SnapshotRow(
        tag=tag,
        dir=str(files.dir),
        created_at_unix=meta.created_at_unix if created_at_unix is None else created_at_unix,
        branched_from=meta.branched_from,
        pause_ms=meta.pause_ms if meta.branched_from else None,
        parent_tag=meta.parent_tag,
        image=meta.image.name if meta.image else None,
        memory_mib=files.machine.memory_mib,
        status=SnapshotStatus.READY,
        metadata=dict(metadata or {}),
        mode=SnapshotMode(meta.mode),
        base_tag=meta.base.tag if meta.base else None,
    )


def memory_file(row: SnapshotRow) -> Path:
    """The file holding a snapshot's memory: ``memory.bin``, or a diff's ``memory.diff``."""
    name = snapshot_files.MEMORY_DIFF if row.mode == "diff" else snapshot_files.MEMORY
    return Path(row.dir) / name


# More work on a template before its snapshot: E2B's build steps (forkd.controller.e2b).
Prepare = Callable[[SandboxVM], Awaitable[None]]


def _memory_mib(req: SnapshotCreate, img: images.Image) -> int:
    """A template's guest RAM: the request's, else its image recipe's, else forkd's default."""
    defaults: dict[str, Any] = img.meta.get("template") or {}
    return int(req.memory_mib or defaults.get("memory_mib") or limits.DEFAULT_MEMORY_MIB)


class SnapshotService:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        events: EventBus,
        holds: Holds,
        records: Records,
        pool: ForkPool[SandboxVM],
        launcher: Launcher,
        egress_ca: EgressCA,
        admission: AdmissionControl,
        volumes: VolumeService,
        images: ImageService,
        stop_hooks: StopHooks,
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.events = events
        self.holds = holds
        self.records = records
        self.pool = pool
        self.launcher = launcher
        self.egress_ca = egress_ca
        self.admission = admission
        self.volumes = volumes
        self.images = images
        self.stop_hooks = stop_hooks
        self.root = self.settings.snapshot_root
        # Compaction and deletion change files under the root: one at a time.
        self._disk_lock = asyncio.Lock()

    # ------------------------------------------------------------ create

    async def create(self, req: SnapshotCreate, prepare: Prepare | None = None) -> SnapshotInfo:
        """Boot a template, run its setup and warm-up, snapshot it as ``req.tag``.
        ``prepare`` (the daemon's own callers: E2B's template builds) runs on the
        template after them, before ``start``."""
        tag = limits.check_tag(req.tag)
        template_start.check(req)
        # reserved before an import that may take minutes
        with self.records.reserve_tag(tag), tracing.span("template.build", tag=tag):
            img = await self._resolve_image(req)
            reserve = self.settings.disk_reserve_mib
            require_room(self.root, reserve, f"building snapshot {tag!r}")
            with (
                self.admission.admit(
                    f"building snapshot {tag!r}", 0, template_mib=_memory_mib(req, img)
                ),
                self.holds.volume_layers(),
            ):
                try:
                    started = await self._build(req, img, prepare)
                except TemplateSetupFailed:
                    raise  # its message says which command failed
                except StorageFull as exc:
                    raise StorageFull(f"building snapshot {tag!r} failed: {exc}") from exc
                except (VMError, AgentError) as exc:
                    raise VMError(f"building snapshot {tag!r} failed: {exc}") from exc
                finally:
                    if self.store.get_snapshot(tag) is None:  # failed after the commit
                        shutil.rmtree(self.root / tag, ignore_errors=True)
        hook = StopHook(req.on_stop, req.on_stop_timeout_s) if req.on_stop else None
        self.stop_hooks.for_snapshot(tag, hook)  # every fork of it takes it
        info = self.info(tag)
        return info if started is None else info.model_copy(update={"start": started})

    async def _resolve_image(self, req: SnapshotCreate) -> images.Image:
        if req.kernel or req.rootfs:
            parents = {Path(p).parent for p in (req.kernel, req.rootfs) if p}
            try:
                if len(parents) != 1:
                    raise ImageError("they are in different directories")
                return images.find_image(str(next(iter(parents))))
            except ImageError as exc:
                raise Invalid(
                    "kernel/rootfs must name files of one forkd image directory "
                    f"({exc}); or pass 'image' (see 'forkd image ls')"
                ) from exc
        return await self.images.resolve(req.image)

    async def _build(
        self, req: SnapshotCreate, img: images.Image, prepare: Prepare | None
    ) -> str | None:
        """The template built and snapshotted; with ``start``, what was waited for."""
        # The image recipe's template settings come first; the request adds to them.
        defaults: dict[str, Any] = img.meta.get("template") or {}
        setup = [*(defaults.get("setup") or []), *req.setup]
        warmups = [w for w in (defaults.get("warmup"), req.warmup) if w]
        template = await self._boot(req, img, defaults)
        events = self.events

        def progress(step: str, message: str, output: str = "") -> None:
            fields = {"output": output} if output else {}
            events.publish(
                "snapshot_progress", snapshot_tag=req.tag, step=step, message=message, **fields
            )

        try:
            ca = self.egress_ca if self.launcher.network.egress is not None else None
            await template_start.configure(template, img, req, ca.pem if ca else None)
            progress(
                "setup", f"booted; running {len(setup)} setup command(s), {len(warmups)} warm-up(s)"
            )
            await template_start.run_setup(template, setup, warmups)
            if prepare is not None:
                await prepare(template)
            said = await template_start.start(
                template, img, req, lambda message, output: progress("start", message, output)
            )
            progress("snapshot", "taking the snapshot")
            started = time.monotonic()
            await template.snapshot(self.root / req.tag, SnapshotLabels(tag=req.tag))
            self.metrics.snapshot_seconds.observe(time.monotonic() - started)
            files = snapshot_files.load(self.root / req.tag)
            with self.store.transaction():  # the event's outbox rows with the registration
                self.store.add_snapshot(snapshot_row(req.tag, files, now(), req.metadata))
                self.events.publish("snapshot_created", snapshot_tag=req.tag)
        finally:
            await template.kill()
        return said

    async def _boot(
        self, req: SnapshotCreate, img: images.Image, defaults: dict[str, Any]
    ) -> SandboxVM:
        """The template's VM, booted with its volumes attached and its network."""
        attach = self.volumes.attach_for_boot(req.volumes)
        self.events.publish(
            "snapshot_progress",
            snapshot_tag=req.tag,
            step="boot",
            message=f"booting image {img.name}",
        )
        try:
            return await self.launcher.driver.boot(
                img,
                run_root=self.settings.run_dir,
                memory_mib=_memory_mib(req, img),
                vcpus=req.vcpus or defaults.get("vcpus") or limits.DEFAULT_VCPUS,
                accel_name=self.settings.accel,
                # The daemon's id prefix marks its VMs (and their namespaces) as its own.
                vm_id=f"tpl-{self.store.id_prefix}-{req.tag[:32]}-{os.urandom(2).hex()}",
                boot_timeout=req.boot_wait_secs,
                attach=attach,
                host_network=self.launcher.network,
                egress_policy=egress.requested(req.egress, None, req.network),
                cgroup=self.launcher.placement(),
            )
        except BaseException:
            self.volumes.discard_unused(attach)  # made, but no VM took them
            raise

    # ------------------------------------------------------------ read

    @contextlib.contextmanager
    def reading(self, tag: str) -> Iterator[None]:
        """Hold ``tag`` against deletion while its files are read (409 for a delete)."""
        release = self.hold_for_reading(tag)
        try:
            yield
        finally:
            release()

    def hold_for_reading(self, tag: str) -> Callable[[], None]:
        """:meth:`reading` for a hold that ends elsewhere: the function returned ends
        it (once, however often it is called)."""
        return self.holds.hold_reading(tag)

    def info(self, tag: str, detailed: bool = False) -> SnapshotInfo:
        row = self.records.snapshot_row(tag)
        d = Path(row.dir)
        problem = self.unbootable_reason(row)
        fields: dict[str, Any] = {
            "tag": row.tag,
            "dir": self.settings.shown_path(row.dir),
            "vmstate": self.settings.shown_path(d / snapshot_files.VMSTATE),
            "memory": self.settings.shown_path(memory_file(row)),
            "created_at_unix": row.created_at_unix,
        }
        if row.branched_from is not None:
            pause = None if row.pause_ms is None else round(row.pause_ms)
            fields.update(branched_from=row.branched_from, pause_ms=pause)
        settled = row.status not in (SnapshotStatus.WRITING, SnapshotStatus.FAILED)
        fields.update(
            status=row.status if problem is None or not settled else "broken",
            bootable=problem is None,
            memory_mib=row.memory_mib,
            image=row.image,
            parent_tag=row.parent_tag,
            metadata=row.metadata,
            mode=row.mode,
        )
        fields.update({k: v for k, v in (("base_tag", row.base_tag), ("error", row.error)) if v})
        # The original forkd's 'warning': why the snapshot cannot be forked (a file's path
        # in it is the daemon's, as in errors, unless host paths are shown).
        settings = self.settings
        if problem is not None and not settings.show_host_paths:
            problem = hide_host_paths(problem.replace(str(settings.snapshot_root), "snapshots"))
        if row.status == SnapshotStatus.FAILED and row.error:
            fields["warning"] = row.error
        elif problem is not None and settled:
            fields["warning"] = f"snapshot is not bootable: {problem}"
        if detailed:
            fields.update(self._detail(row, d))
            if problem:
                fields["problem"] = problem
        return SnapshotInfo(**fields)

    def _detail(self, row: SnapshotRow, d: Path) -> dict[str, Any]:
        mem, vmstate = memory_file(row), d / snapshot_files.VMSTATE
        mst = mem.stat() if mem.exists() else None
        ancestors = self._ancestors(row)[::-1]  # the root first, as the original contract
        store = self.store
        return {
            "memory_logical_bytes": mst.st_size if mst else 0,
            "memory_physical_bytes": mst.st_blocks * 512 if mst else 0,
            "vmstate_bytes": vmstate.stat().st_size if vmstate.exists() else 0,
            "chain_depth": len(ancestors),
            "ancestors": ancestors,
            "dependents": [r.tag for r in store.list_snapshots() if r.parent_tag == row.tag],
            "sandboxes": [r.id for r in store.list_sandboxes() if r.snapshot_tag == row.tag],
            "diff_chain": self._bases(row),
            "diff_dependents": self._diff_dependents(row.tag),
        }

    def diff_depth(self, row: SnapshotRow) -> int:
        """The diff layers a fork of ``row`` applies over its full root (0: a full one)."""
        return len(self._bases(row))

    def _bases(self, row: SnapshotRow) -> list[str]:
        """A diff's bases in the registry, nearest first (empty for a full snapshot)."""
        return self._walk(row, lambda r: r.base_tag)

    def _diff_dependents(self, tag: str) -> list[str]:
        return [r.tag for r in self.store.list_snapshots() if r.base_tag == tag]

    def _ancestors(self, row: SnapshotRow) -> list[str]:
        """Its lineage (parent_tag), nearest first."""
        return self._walk(row, lambda r: r.parent_tag)

    def _walk(self, row: SnapshotRow, up: Callable[[SnapshotRow], str | None]) -> list[str]:
        return walk_snapshots(row, self.store.get_snapshot, up)

    @staticmethod
    def unbootable_reason(row: SnapshotRow) -> str | None:
        if row.status == SnapshotStatus.WRITING:
            return "it is writing: a branch in the background is still writing it"
        if row.status == SnapshotStatus.FAILED:
            return f"its branch failed: {row.error}"
        try:
            files = snapshot_files.load(Path(row.dir))
            if files.is_diff:  # every base down to the full root must be whole
                memory_diff.resolve(files).close()
        except SnapshotError as exc:
            return str(exc)
        return None

    def list(self, metadata: dict[str, str] | None = None) -> builtins.list[SnapshotInfo]:
        """The snapshots labelled with all of ``metadata``."""
        rows = self.store.list_snapshots()
        return [self.info(r.tag) for r in rows if labelled(r.metadata, metadata)]

    # ------------------------------------------------------------ delete

    async def compact(self, tag: str) -> SnapshotInfo:
        """Flatten the diff ``tag`` into a full snapshot in place (a full one: as it is)."""
        async with self._disk_lock:
            await self._compact_locked(self.records.snapshot_row(tag))
        return self.info(tag, detailed=True)

    async def compact_to(self, tag: str, to: str) -> SnapshotInfo:
        """A new full snapshot ``to`` with ``tag``'s content (a diff's chain flattened),
        flat as the original forkd made it: no parent (depth 0), the source's
        ``branched_from`` kept; ``tag`` is left as it is."""
        limits.check_tag(to)
        if to == tag:
            raise Invalid(f"compact to {to!r}: the new tag must differ from the source's")
        row = self.records.snapshot_row(tag)
        if row.status in (SnapshotStatus.WRITING, SnapshotStatus.FAILED):
            raise Conflict(f"snapshot {tag!r} is {row.status}: nothing to compact")
        problem = self.unbootable_reason(row)
        if problem is not None:
            raise Conflict(f"snapshot {tag!r} cannot be compacted: {problem}")
        dest = self.settings.snapshot_root / to
        with self.records.reserve_tag(to):  # 409 when the tag or its directory exists
            labels = SnapshotLabels(tag=to, branched_from=row.branched_from)
            async with self._disk_lock:
                try:
                    files = await asyncio.to_thread(
                        snapshot_compact.compact_to, Path(row.dir), dest, labels
                    )
                except StorageFull as exc:
                    raise StorageFull(f"compacting {tag!r} to {to!r}: {exc}") from exc
            self.store.add_snapshot(snapshot_row(to, files, now(), row.metadata))
        return self.info(to, detailed=True)

    async def _compact_locked(self, row: SnapshotRow) -> None:
        if row.status in (SnapshotStatus.WRITING, SnapshotStatus.FAILED):
            raise Conflict(f"snapshot {row.tag!r} is {row.status}: nothing to compact")
        if row.mode != "diff":
            return
        problem = self.unbootable_reason(row)
        if problem is not None:
            raise Conflict(f"snapshot {row.tag!r} cannot be compacted: {problem}")
        try:
            await asyncio.to_thread(snapshot_compact.compact, Path(row.dir))
        except StorageFull as exc:
            raise StorageFull(f"compacting {row.tag!r}: {exc}") from exc
        self.store.update_snapshot(row.tag, mode=SnapshotMode.FULL, base_tag=None)

    async def delete(self, tag: str, cascade: bool = False, force: bool = False) -> None:
        """Delete ``tag``; with ``cascade`` the diff snapshots over it first (deepest first),
        with ``force`` those are compacted and kept. :class:`Conflict` naming them when it
        has dependents and neither is given, or when any of them is being written."""
        if cascade and force:
            raise Invalid("cascade and force exclude each other: delete dependents or keep them")
        async with self._disk_lock:
            order = self._deletion_order(self.records.snapshot_row(tag), cascade, force)
            with self.holds.deleting(order):  # before any await: no new diff over them
                if force:
                    for dep in self._diff_dependents(tag):
                        await self._compact_locked(self.records.snapshot_row(dep))
                for victim in order:
                    await self._delete_one(victim)

    def _deletion_order(self, row: SnapshotRow, cascade: bool, force: bool) -> builtins.list[str]:
        """``row``'s tag last, after its diff dependents (all of them, deepest first) when
        ``cascade``; every check is made before anything is deleted."""
        order: builtins.list[str] = []

        def visit(r: SnapshotRow, path: tuple[str, ...]) -> None:
            if r.status == SnapshotStatus.WRITING:
                raise Conflict(f"snapshot {r.tag!r} is writing: retry when its branch settles")
            if self.holds.base_in_use(r.tag):
                raise Conflict(f"a diff branch over snapshot {r.tag!r} is being written; retry")
            if self.holds.being_read(r.tag):
                raise Conflict(f"snapshot {r.tag!r} is being pushed; retry when it is done")
            deps = self._diff_dependents(r.tag)
            if deps and not (cascade or force):
                raise Conflict(
                    f"snapshot {r.tag!r} is the base of diff snapshots {', '.join(deps)}: "
                    "delete them first, or pass cascade=true (delete them too) or "
                    "force=true (compact them into full snapshots and keep them)"
                )
            for dep in deps:
                drow = self.records.snapshot_row(dep)
                if cascade and dep not in path and dep not in order:
                    visit(drow, (*path, dep))
                elif (
                    force and drow.status != SnapshotStatus.READY
                ):  # to be compacted: must be whole
                    raise Conflict(f"diff snapshot {dep!r} over {r.tag!r} is {drow.status}")
            order.append(r.tag)

        visit(row, (row.tag,))
        return order

    async def _delete_one(self, tag: str) -> None:
        row = self.records.snapshot_row(tag)
        d = Path(row.dir)
        await self.pool.drop(d)
        # Checked again after the awaits, just before the files go.
        if self.holds.base_in_use(tag):
            raise Conflict(f"a diff branch over snapshot {tag!r} is being written; retry")
        if self.holds.being_read(tag):
            raise Conflict(f"snapshot {tag!r} is being pushed; retry when it is done")
        deps = self._diff_dependents(tag)
        if deps:
            raise Conflict(f"snapshot {tag!r} is the base of diff snapshots {', '.join(deps)}")
        # Out of the way first (a crash leaves a staging name that start-up
        # removes), then unregistered, then deleted. Running children keep
        # their mapping of memory.bin; only the directory entry goes.
        trash = d.parent / f".{d.name}.partial-del-{os.urandom(3).hex()}"
        with contextlib.suppress(FileNotFoundError):
            d.rename(trash)
        with self.store.transaction():  # the event's outbox rows with the deletion
            self.store.delete_snapshot(tag)
            self.events.publish("snapshot_deleted", snapshot_tag=tag)
        self.stop_hooks.forget_snapshot(tag)
        await asyncio.to_thread(shutil.rmtree, trash, True)
        self.volumes.collect_layers()
