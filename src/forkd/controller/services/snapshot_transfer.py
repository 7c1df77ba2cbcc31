"""Snapshots to and from OCI registries: ``push`` and ``pull`` (see :mod:`forkd.oci`).

A push reads a ready snapshot (a delete meanwhile is refused with 409) and
sends it as an OCI artifact. When its diff base, or the snapshot it was
branched from, is already that repository's manifest (this daemon pushed or
pulled it), only the pages that differ go up: the base is pushed first when
it is a diff's and missing, so a chain always travels whole.

A pull reads the manifest and config, checks everything this host needs to
restore it (QEMU, accelerator, CPU, memory limits, image build) and answers
409 naming every mismatch before writing anything; then writes the
snapshot into a staging directory, renames it into place and registers it.
Any failure removes the staging directory: a partial pull leaves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import secrets
import shutil
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from forkd import limits
from forkd.controller.metrics import Metrics
from forkd.controller.models import PushResult, SnapshotInfo, SnapshotPull, SnapshotPush
from forkd.controller.services import pull_writing, transfer_records
from forkd.controller.services.disk_room import require_room
from forkd.controller.services.events import EventBus
from forkd.controller.services.received import receive_to
from forkd.controller.services.records import Records
from forkd.controller.services.snapshot_archive import ArchiveReader, ArchiveWriter, MeteredFile
from forkd.controller.services.snapshots import SnapshotService, snapshot_row
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SnapshotRow, now
from forkd.disk_reserve import DiskReserve
from forkd.errors import (
    Busy,
    Conflict,
    Invalid,
    SnapshotError,
    StorageFull,
    UpstreamError,
)
from forkd.image_import.local_sources import TarFiles
from forkd.oci import (
    auth,
    pull,
    push,
    volume_files,
)
from forkd.oci.policy import RegistryPolicy
from forkd.oci.pull import Remote
from forkd.oci.push import Base, Pushed
from forkd.oci.reference import Reference
from forkd.oci.registry import Registry
from forkd.oci.repository import PullSource, PushTarget
from forkd.states import SnapshotStatus
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory_diff
from forkd.vmm.snapshot.files import SnapshotFiles
from forkd.vmm.snapshot.memory_diff import Chain

log = logging.getLogger(__name__)
ARCHIVE = "the snapshot archive"  # how messages name an archive a client sent
MAX_TRANSFERS = 3  # pushes and pulls at once
T = TypeVar("T")


class SnapshotTransfer:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        events: EventBus,
        records: Records,
        snapshots: SnapshotService,
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.events = events
        self.records = records
        self.snapshots = snapshots
        self.root = self.settings.snapshot_root
        # Transfers take minutes: their own threads, never the default pool's that forks,
        # branches and networks need; past the cap a transfer is a 503 to retry.
        self._pool = ThreadPoolExecutor(MAX_TRANSFERS, thread_name_prefix="forkd-transfer")
        self._running = 0
        self._receiving = 0  # snapshot archives on their way in

    # ------------------------------------------------------------ plumbing

    async def _in_thread(
        self, fn: Callable[..., T], *args: Any, then: Callable[[], None] | None = None
    ) -> T:
        """``fn(*args)`` on a transfer thread, then ``then()``. A cancelled caller does
        not stop the thread: it finishes, or cleans up after itself (a pull commits or
        removes all), and it counts toward the cap, and ``then`` waits, until it has."""
        if self._running >= MAX_TRANSFERS:
            if then is not None:
                then()
            raise Busy(f"{MAX_TRANSFERS} pushes and pulls are running: retry shortly")
        self._running += 1
        work = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

        def finished(_: object) -> None:
            self._running -= 1
            if then is not None:
                then()

        work.add_done_callback(finished)
        return await asyncio.shield(work)

    def _target(self, text: str, plain_asked: bool) -> tuple[Reference, RegistryPolicy]:
        """The reference ``text`` names, checked against the operator's registry policy:
        :class:`Invalid` (400) before any name is looked up or anything contacted."""
        settings = self.settings
        registries = settings.registries()
        policy = RegistryPolicy.of(registries.insecure_registries, registries.default_registry)
        ref = policy.parse(text)
        policy.scheme(ref, plain_asked)  # a request may ask only for what the operator allowed
        return ref, policy

    def _registry(self, ref: Reference, policy: RegistryPolicy, token: str | None) -> Registry:
        creds = auth.Credentials(bearer=token) if token else None
        if creds is None:
            creds = auth.from_docker_config(ref.registry, self.settings.registry_auth)
        return Registry(ref, policy=policy, credentials=creds)

    def _local(self, snapshot_id: str) -> tuple[SnapshotRow, SnapshotFiles] | None:
        """The ready snapshot on this host whose id is ``snapshot_id``."""
        for row in self.store.list_snapshots():
            if row.status != SnapshotStatus.READY:
                continue
            try:
                files = snapshot_files.load(Path(row.dir))
            except SnapshotError:
                continue
            if files.meta.id == snapshot_id:
                return row, files
        return None

    # ------------------------------------------------------------ push

    async def push(self, tag: str, req: SnapshotPush) -> PushResult:
        ref, policy = self._target(req.ref, req.insecure)
        if ref.digest:
            raise Invalid("push to a tag (registry/repository:tag), not to a digest")
        row = self.records.snapshot_row(tag)
        if row.status != SnapshotStatus.READY:
            raise Conflict(f"snapshot {tag!r} is {row.status}: nothing to push")
        # Held against deletion until the push thread is done with the files, even
        # when the request goes away first.
        release = self.snapshots.hold_for_reading(tag)
        try:
            files = snapshot_files.load(Path(row.dir))
            registry = self._registry(ref, policy, req.token)
        except BaseException as exc:
            release()
            if isinstance(exc, SnapshotError):
                raise Conflict(f"snapshot {tag!r} cannot be pushed: {exc}") from exc
            raise
        try:
            pushed = await self._in_thread(
                self._push_closing,
                registry,
                files,
                row,
                ref.tag or "latest",
                req.flatten,
                then=release,
            )
        except Busy:
            registry.close()  # never handed to a thread
            raise
        self.metrics.registry_bytes.labels(direction="push").inc(pushed.bytes_uploaded)
        log.info(
            "pushed %s to %s@%s: %d of %d bytes sent (%s)",
            tag,
            ref,
            pushed.digest,
            pushed.bytes_uploaded,
            pushed.bytes_total,
            pushed.encoding,
        )
        return PushResult(ref=str(ref), **vars(pushed))

    def _push_closing(self, registry: PushTarget, *args: Any) -> Pushed:
        try:
            return self._push_one(registry, *args)
        finally:
            registry.close()

    def _push_one(
        self,
        registry: PushTarget,
        files: SnapshotFiles,
        row: SnapshotRow,
        reference_: str | None,
        flatten: bool,
        depth: int = 0,
    ) -> Pushed:
        """Push ``files``, a diff's bases first when the repository lacks them (in a thread)."""
        repo = f"{registry.ref.registry}/{registry.ref.repository}"
        config = transfer_records.config(files, row)  # first: nothing to close if it fails
        base = None if flatten else self._base(registry, files, row, depth)
        image_dir = files.machine.rootfs.parent
        scratch = self.root / f".{row.tag}.partial-push-{secrets.token_hex(3)}"
        try:
            scratch.mkdir(mode=0o700)
            disks = tuple(
                volume_files.raw_disk(att, scratch, i) for i, att in enumerate(files.meta.volumes)
            )
            config["volumes"] = [
                {
                    "name": att.name,
                    "path": att.path,
                    "readonly": att.readonly,
                    "size_bytes": disk.stat().st_size,
                }
                for att, disk in zip(files.meta.volumes, disks, strict=True)
            ]
            pushed = push.push(
                files, image_dir, config, registry, reference_, base, log.debug, disks
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            if base is not None:
                base.chain.close()
        assert files.meta.id is not None  # load() gives every snapshot one
        self.store.record_digest(files.meta.id, repo, pushed.digest)
        return pushed

    def _base(
        self, registry: PushTarget, files: SnapshotFiles, row: SnapshotRow, depth: int
    ) -> Base | None:
        """What to push ``files`` as a delta over: its diff base (pushed first if the
        repository lacks it), else the snapshot it came from if the repository has it."""
        store = self.store
        if files.is_diff and files.meta.base is not None and depth < limits.MAX_DIFF_DEPTH:
            base_files = snapshot_files.load(Path(files.meta.base.dir))
            assert base_files.meta.id is not None
            digest = self._pushed_as(registry, base_files.meta.id)
            if digest is None:
                base_row = store.get_snapshot(files.meta.base.tag) or row
                pushed = self._push_one(registry, base_files, base_row, None, False, depth + 1)
                digest = pushed.digest
            with memory_diff.resolve(files) as own:
                candidates = list(own.layers[-1].runs)
            chain = memory_diff.resolve(base_files)
            return push.Base(digest, files.meta.base.tag, chain, candidates)
        parent = self._local(files.meta.parent_id) if files.meta.parent_id else None
        if parent is None:
            return None
        digest = self._pushed_as(registry, files.meta.parent_id or "")
        if digest is None:
            return None
        return push.Base(digest, parent[0].tag, memory_diff.resolve(parent[1]))

    def _pushed_as(self, registry: PushTarget, snapshot_id: str) -> str | None:
        """A digest snapshot ``snapshot_id`` is known by that this repository has."""
        for digest in self.store.digests_of(snapshot_id):
            if registry.has_manifest(digest):
                return digest
        return None

    # ------------------------------------------------------------ archives

    async def export(self, tag: str) -> Path:
        """Snapshot ``tag`` as an OCI archive (the original forkd's ``pack``): a tar file
        of the daemon's, beside the snapshots, that the caller sends and removes. What
        a push would send (a diff's bases too), laid out as an OCI image layout."""
        row = self.records.snapshot_row(tag)
        if row.status != SnapshotStatus.READY:
            raise Conflict(f"snapshot {tag!r} is {row.status}: nothing to pack")
        require_room(self.root, self.settings.disk_reserve_mib, f"packing {tag!r}")
        if len(list(self.root.glob(".*.partial-pack-*.tar"))) >= MAX_TRANSFERS:
            raise Busy(f"{MAX_TRANSFERS} packs are being written or sent: retry shortly")
        reserve = DiskReserve(self.root, self.settings.disk_reserve_mib << 20)
        release = self.snapshots.hold_for_reading(tag)
        try:
            files = snapshot_files.load(Path(row.dir))
        except BaseException as exc:
            release()
            if isinstance(exc, SnapshotError):
                raise Conflict(f"snapshot {tag!r} cannot be packed: {exc}") from exc
            raise
        out = self.root / f".{tag}.partial-pack-{secrets.token_hex(3)}.tar"

        def pack() -> None:
            try:
                with out.open("xb") as f:
                    metered = MeteredFile(f, reserve.meter(f"packing {tag!r}"))
                    writer = ArchiveWriter(metered, tag, files.meta.created_at_unix)
                    self._push_one(writer, files, row, tag, False)
                    writer.finish()
            except BaseException as exc:
                out.unlink(missing_ok=True)
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    raise StorageFull(f"disk full while packing {tag!r}") from exc
                raise

        await self._in_thread(pack, then=release)
        return out

    async def receive_archive(self, body: AsyncIterator[bytes]) -> Path:
        """An archive a client sends (``POST /v1/snapshots/import``), written beside the
        snapshots as it arrives: within --max-image-mib and --disk-reserve. The caller
        removes it."""
        if self._running + self._receiving >= MAX_TRANSFERS:  # said before the upload
            raise Busy(f"{MAX_TRANSFERS} transfers are running: retry shortly")
        reserve = DiskReserve(self.root, self.settings.disk_reserve_mib << 20)
        meter = reserve.meter("receiving a snapshot archive")
        path = self.root / f".import.partial-{secrets.token_hex(8)}.tar"
        self._receiving += 1
        try:
            with path.open("xb") as out:
                await receive_to(
                    body,
                    out,
                    self.settings.max_image_bytes,
                    meter,
                    ARCHIVE,
                    "--max-image-mib",
                )
        except BaseException as exc:
            path.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise StorageFull(f"writing a snapshot archive: {exc.strerror}") from exc
            raise
        finally:
            self._receiving -= 1
        return path

    async def import_archive(
        self, archive: Path, tag: str | None, metadata: dict[str, str]
    ) -> SnapshotInfo:
        """The snapshot of an OCI archive a client sent (:meth:`export`'s, from this host
        or another: the original forkd's ``unpack``), read as a pull reads a registry,
        every blob checked; ``tag`` names it (default: the tag it was packed as).
        409 when that tag exists or this host cannot restore it; nothing kept on any
        failure. The archive itself is the caller's to remove.

        Each transfer thread opens the archive for itself and closes it when done, so
        a request that goes away never closes it under a thread still reading it."""
        if tag is not None:
            limits.check_tag(tag)

        def inspect() -> tuple[str, Remote, pull_writing.Plan]:
            with TarFiles(archive, shown=ARCHIVE) as files:
                reader = ArchiveReader(files, ARCHIVE)
                packed = reader.only_tag()
                remote = pull.open_remote(reader, packed)
                return packed, remote, pull_writing.plan(remote, self.settings, self.root)

        packed, remote, plan = await self._in_thread(inspect)
        tag = tag or packed
        limits.check_tag(tag)
        if self.store.get_snapshot(tag) is not None:
            raise Conflict(f"snapshot {tag!r} already exists")
        # The tag stays reserved until the thread writing the snapshot is done, even
        # when the request goes away first.
        held = contextlib.ExitStack()
        held.enter_context(self.records.reserve_tag(tag))

        def write() -> int:
            with TarFiles(archive, shown=ARCHIVE) as files:
                reader = ArchiveReader(files, ARCHIVE)
                return self._pull_sync(reader, reader.ref, remote, tag, plan, metadata)

        try:
            await self._in_thread(write, then=held.close)
        except Busy:
            held.close()  # never handed to a thread
            raise
        self.events.publish("snapshot_created", snapshot_tag=tag)
        log.info("unpacked an archive as %s", tag)
        return self.snapshots.info(tag)

    # ------------------------------------------------------------ pull

    async def pull(self, req: SnapshotPull) -> SnapshotInfo:
        ref, policy = self._target(req.ref, req.insecure)
        if req.tag is not None:
            limits.check_tag(req.tag)
            if self.store.get_snapshot(req.tag) is not None:
                raise Conflict(f"snapshot {req.tag!r} already exists")  # before any request
        registry = self._registry(ref, policy, req.token)
        # The registry client and the tag's reservation last until the thread that
        # writes the snapshot is done, even when the request goes away first.
        held = contextlib.ExitStack()
        held.callback(registry.close)
        handed = False
        try:
            remote = await self._in_thread(pull.open_remote, registry, ref.reference)
            tag = req.tag or transfer_records.pushed_tag(remote.config) or ref.tag
            if not tag:
                raise Invalid("give a tag: the reference and the snapshot name none")
            limits.check_tag(tag)
            held.enter_context(self.records.reserve_tag(tag))
            plan = await self._in_thread(pull_writing.plan, remote, self.settings, self.root)
            handed = True
            fetched = await self._in_thread(
                self._pull_sync,
                registry,
                ref,
                remote,
                tag,
                plan,
                req.metadata,
                then=held.close,
            )
        finally:
            if not handed:
                held.close()
        self.metrics.registry_bytes.labels(direction="pull").inc(fetched)
        self.events.publish("snapshot_created", snapshot_tag=tag)
        log.info("pulled %s as %s: %d bytes fetched", remote.where, tag, fetched)
        return self.snapshots.info(tag)

    def _pull_sync(
        self,
        registry: PullSource,
        ref: Reference,
        remote: Remote,
        tag: str,
        plan: pull_writing.Plan,
        metadata: dict[str, str],
    ) -> int:
        """Write, commit and register the snapshot (in a transfer thread); on any failure
        remove everything it made. Returns the bytes fetched."""
        staging = self.root / f".{tag}.partial-pull-{secrets.token_hex(3)}"
        final = self.root / tag
        downloads = pull.Downloads(registry)
        made = pull_writing.Made()
        try:
            staging.mkdir(mode=0o700, parents=True)
            pull_writing.write(
                registry,
                remote,
                downloads,
                staging,
                plan,
                made,
                self._chain_of,
                self.snapshots.volumes.store,
            )
            staging.rename(final)
            snapshot_files.fsync_path(self.root)
            files = snapshot_files.load(final)
            self.store.add_snapshot(snapshot_row(tag, files, now(), metadata))
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if self.store.get_snapshot(tag) is None:
                shutil.rmtree(final, ignore_errors=True)
                made.remove(self.snapshots.volumes.store)
            if isinstance(exc, OSError):
                if exc.errno == errno.ENOSPC:
                    raise StorageFull(f"disk full while pulling {remote.where}") from exc
                raise UpstreamError(f"pulling {remote.where} failed: {exc}") from exc
            raise
        assert files.meta.id is not None
        self.store.record_digest(files.meta.id, f"{ref.registry}/{ref.repository}", remote.digest)
        return downloads.bytes

    def _chain_of(self, digest: str) -> Chain | None:
        """The memory of a snapshot on this host known as manifest ``digest``."""
        for snapshot_id in self.store.snapshots_of_digest(digest):
            found = self._local(snapshot_id)
            if found is not None:
                with contextlib.suppress(SnapshotError):
                    return memory_diff.resolve(found[1])
        return None
