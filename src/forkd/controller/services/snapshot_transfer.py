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
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from forkd import accel, limits, paths
from forkd.controller.models import PushResult, SnapshotInfo, SnapshotPull, SnapshotPush
from forkd.controller.services import transfer_records
from forkd.controller.services.disk_room import require_room
from forkd.controller.services.fleet import Fleet
from forkd.controller.services.received import receive_to
from forkd.controller.services.snapshot_archive import ArchiveReader, ArchiveWriter, MeteredFile
from forkd.controller.services.snapshots import SnapshotService, snapshot_row
from forkd.controller.store_rows import SnapshotRow, now
from forkd.disk_reserve import DiskReserve, free_bytes
from forkd.errors import (
    Busy,
    Conflict,
    Invalid,
    NoRoom,
    SnapshotError,
    StorageFull,
    UpstreamError,
)
from forkd.guest import pulled_image
from forkd.image_import.local_sources import TarFiles
from forkd.oci import (
    artifact,
    auth,
    host_needs,
    image_files,
    pull,
    push,
    volume_files,
)
from forkd.oci.policy import RegistryPolicy
from forkd.oci.pull import Downloads, Remote
from forkd.oci.push import Base, Pushed
from forkd.oci.reference import Reference
from forkd.oci.registry import Registry
from forkd.oci.repository import PullSource, PushTarget
from forkd.states import SnapshotStatus
from forkd.vmm.jail import egress
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory_diff
from forkd.vmm.snapshot.files import SnapshotFiles
from forkd.vmm.snapshot.memory_diff import Chain
from forkd.vmm.volumes.disks import Attachment, VolumeStore

log = logging.getLogger(__name__)
PULL_RESERVE_BYTES = 256 << 20  # a pull leaves this much of the disk free
ARCHIVE = "the snapshot archive"  # how messages name an archive a client sent
MAX_TRANSFERS = 3  # pushes and pulls at once
T = TypeVar("T")


class SnapshotTransfer:
    def __init__(self, fleet: Fleet, snapshots: SnapshotService) -> None:
        self.fleet = fleet
        self.snapshots = snapshots
        self.root = fleet.settings.snapshot_root
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
        settings = self.fleet.settings
        registries = settings.registries()
        policy = RegistryPolicy.of(registries.insecure_registries, registries.default_registry)
        ref = policy.parse(text)
        policy.scheme(ref, plain_asked)  # a request may ask only for what the operator allowed
        return ref, policy

    def _registry(self, ref: Reference, policy: RegistryPolicy, token: str | None) -> Registry:
        creds = auth.Credentials(bearer=token) if token else None
        if creds is None:
            creds = auth.from_docker_config(ref.registry, self.fleet.settings.registry_auth)
        return Registry(ref, policy=policy, credentials=creds)

    def _local(self, snapshot_id: str) -> tuple[SnapshotRow, SnapshotFiles] | None:
        """The ready snapshot on this host whose id is ``snapshot_id``."""
        for row in self.fleet.store.list_snapshots():
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
        row = self.fleet.snapshot_row(tag)
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
        self.fleet.metrics.registry_bytes.labels(direction="push").inc(pushed.bytes_uploaded)
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
        self.fleet.store.record_digest(files.meta.id, repo, pushed.digest)
        return pushed

    def _base(
        self, registry: PushTarget, files: SnapshotFiles, row: SnapshotRow, depth: int
    ) -> Base | None:
        """What to push ``files`` as a delta over: its diff base (pushed first if the
        repository lacks it), else the snapshot it came from if the repository has it."""
        store = self.fleet.store
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
        for digest in self.fleet.store.digests_of(snapshot_id):
            if registry.has_manifest(digest):
                return digest
        return None

    # ------------------------------------------------------------ archives

    async def export(self, tag: str) -> Path:
        """Snapshot ``tag`` as an OCI archive (the original forkd's ``pack``): a tar file
        of the daemon's, beside the snapshots, that the caller sends and removes. What
        a push would send (a diff's bases too), laid out as an OCI image layout."""
        row = self.fleet.snapshot_row(tag)
        if row.status != SnapshotStatus.READY:
            raise Conflict(f"snapshot {tag!r} is {row.status}: nothing to pack")
        require_room(self.root, self.fleet.settings.disk_reserve_mib, f"packing {tag!r}")
        if len(list(self.root.glob(".*.partial-pack-*.tar"))) >= MAX_TRANSFERS:
            raise Busy(f"{MAX_TRANSFERS} packs are being written or sent: retry shortly")
        reserve = DiskReserve(self.root, self.fleet.settings.disk_reserve_mib << 20)
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
        reserve = DiskReserve(self.root, self.fleet.settings.disk_reserve_mib << 20)
        meter = reserve.meter("receiving a snapshot archive")
        path = self.root / f".import.partial-{secrets.token_hex(8)}.tar"
        self._receiving += 1
        try:
            with path.open("xb") as out:
                await receive_to(
                    body,
                    out,
                    self.fleet.settings.max_image_bytes,
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

        def inspect() -> tuple[str, Remote, _Plan]:
            with TarFiles(archive, shown=ARCHIVE) as files:
                reader = ArchiveReader(files, ARCHIVE)
                packed = reader.only_tag()
                remote = pull.open_remote(reader, packed)
                return packed, remote, self._check(remote)

        packed, remote, plan = await self._in_thread(inspect)
        tag = tag or packed
        limits.check_tag(tag)
        if self.fleet.store.get_snapshot(tag) is not None:
            raise Conflict(f"snapshot {tag!r} already exists")
        # The tag stays reserved until the thread writing the snapshot is done, even
        # when the request goes away first.
        held = contextlib.ExitStack()
        held.enter_context(self.fleet.reserve_tag(tag))

        def write() -> int:
            with TarFiles(archive, shown=ARCHIVE) as files:
                reader = ArchiveReader(files, ARCHIVE)
                return self._pull_sync(reader, reader.ref, remote, tag, plan, metadata)

        try:
            await self._in_thread(write, then=held.close)
        except Busy:
            held.close()  # never handed to a thread
            raise
        self.fleet.events.publish("snapshot_created", snapshot_tag=tag)
        log.info("unpacked an archive as %s", tag)
        return self.snapshots.info(tag)

    # ------------------------------------------------------------ pull

    async def pull(self, req: SnapshotPull) -> SnapshotInfo:
        ref, policy = self._target(req.ref, req.insecure)
        if req.tag is not None:
            limits.check_tag(req.tag)
            if self.fleet.store.get_snapshot(req.tag) is not None:
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
            held.enter_context(self.fleet.reserve_tag(tag))
            plan = await self._in_thread(self._check, remote)
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
        self.fleet.metrics.registry_bytes.labels(direction="pull").inc(fetched)
        self.fleet.events.publish("snapshot_created", snapshot_tag=tag)
        log.info("pulled %s as %s: %d bytes fetched", remote.where, tag, fetched)
        return self.snapshots.info(tag)

    def _check(self, remote: Remote) -> _Plan:
        """Every reason this host cannot restore ``remote`` (409 naming them all); else
        what the pull will write."""
        kvm = accel.choose(self.fleet.settings.accel).name == "kvm"
        problems = host_needs.mismatches(remote.config["needs"], kvm)
        machine, needs = remote.config["machine"], remote.config["needs"]
        for key in ("memory_mib", "vcpus", "accel"):  # the checked needs are the machine
            if machine.get(key) != needs.get(key):
                problems.append(f"its machine and its needs disagree on {key}")
        if machine.get("memory_mib") != remote.memory_bytes >> 20:
            problems.append("its machine and its memory disagree on the guest's size")
        try:
            egress.of_machine(machine.get("egress"), bool(machine.get("internet", True)))
        except Invalid as exc:
            problems.append(f"its egress policy is invalid here: {exc}")
        volumes = volume_files.wanted(remote.manifest, remote.config)  # malformed: 502
        files = image_files.wanted(remote.manifest, artifact.image_file_names(remote.config))
        try:
            image_meta = pulled_image.checked(remote.config["image"].get("meta") or {})
        except pulled_image.PulledImageInvalid as exc:
            raise UpstreamError(
                f"{remote.where} is not a snapshot this forkd can use: {exc}"
            ) from exc
        image_dir = image_files.local_dir(paths.images_dir(), remote.config, files)
        if problems:
            why = "; ".join(problems)
            raise Conflict(f"{remote.where} cannot be restored on this host: {why}")
        image_bytes = 0 if image_dir else sum(n for f in files.values() for _o, n, _d in f)
        reserve = max(PULL_RESERVE_BYTES, self.fleet.settings.disk_reserve_mib << 20)
        need = image_bytes + sum(v["size_bytes"] for v in volumes)
        _check_room(self.root, remote, need, reserve)
        return _Plan(image_dir, files, image_meta, volumes)

    def _pull_sync(
        self,
        registry: PullSource,
        ref: Reference,
        remote: Remote,
        tag: str,
        plan: _Plan,
        metadata: dict[str, str],
    ) -> int:
        """Write, commit and register the snapshot (in a transfer thread); on any failure
        remove everything it made. Returns the bytes fetched."""
        staging = self.root / f".{tag}.partial-pull-{secrets.token_hex(3)}"
        final = self.root / tag
        downloads = pull.Downloads(registry)
        made = _Made()
        try:
            staging.mkdir(mode=0o700, parents=True)
            self._write(registry, remote, downloads, staging, plan, made)
            staging.rename(final)
            snapshot_files.fsync_path(self.root)
            files = snapshot_files.load(final)
            self.fleet.store.add_snapshot(snapshot_row(tag, files, now(), metadata))
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if self.fleet.store.get_snapshot(tag) is None:
                shutil.rmtree(final, ignore_errors=True)
                made.remove(self.snapshots.volumes.store)
            if isinstance(exc, OSError):
                if exc.errno == errno.ENOSPC:
                    raise StorageFull(f"disk full while pulling {remote.where}") from exc
                raise UpstreamError(f"pulling {remote.where} failed: {exc}") from exc
            raise
        assert files.meta.id is not None
        self.fleet.store.record_digest(
            files.meta.id, f"{ref.registry}/{ref.repository}", remote.digest
        )
        return downloads.bytes

    def _write(
        self,
        registry: PullSource,
        remote: Remote,
        downloads: Downloads,
        staging: Path,
        plan: _Plan,
        made: _Made,
    ) -> SnapshotFiles:
        """The snapshot's files in ``staging`` (in a thread); the image first if missing."""
        image_dir = plan.image_dir
        if image_dir is None:
            image_dir = image_files.install(
                paths.images_dir(),
                remote.config,
                plan.image_pieces,
                downloads.fetch,
                plan.image_meta,
            )
            made.images.append(image_dir)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = os.open(staging / snapshot_files.VMSTATE, flags, 0o600)
        try:
            vmstate_bytes = pull.write_vmstate(remote, downloads, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(staging / snapshot_files.MEMORY, flags, 0o600)
        try:
            pull.write_memory(registry, remote, downloads, fd, self._chain_of)
            os.fsync(fd)
        finally:
            os.close(fd)
        attachments = self._write_volumes(remote, plan.volumes, downloads, made)
        meta = transfer_records.pulled_meta(remote, image_dir, vmstate_bytes, attachments)
        snapshot_files.fsync_path(snapshot_files.write_meta(staging, meta))
        return SnapshotFiles(staging, meta)

    def _write_volumes(
        self,
        remote: Remote,
        volumes: list[dict[str, Any]],
        downloads: Downloads,
        made: _Made,
    ) -> tuple[Attachment, ...]:
        """Each volume the snapshot carries, as a new volume of this daemon (its name, or
        the name with a suffix when taken); they go again if the pull fails."""
        store = self.snapshots.volumes.store
        attachments = []
        for vol in volumes:

            def fill(fd: int, vol: dict[str, Any] = vol) -> None:
                volume_files.write(remote.manifest, vol, downloads.pieces, fd)

            name = store.create_filled(vol["name"], vol["size_bytes"], fill)
            made.volumes.append(name)
            base = (str(store.base(name)),)
            attachments.append(Attachment(name, vol["path"], vol["readonly"], base))
        return tuple(attachments)

    def _chain_of(self, digest: str) -> Chain | None:
        """The memory of a snapshot on this host known as manifest ``digest``."""
        for snapshot_id in self.fleet.store.snapshots_of_digest(digest):
            found = self._local(snapshot_id)
            if found is not None:
                with contextlib.suppress(SnapshotError):
                    return memory_diff.resolve(found[1])
        return None


@dataclass(frozen=True)
class _Plan:
    """What a checked pull will write: the image directory it uses (``None``: the
    image's pieces are pulled too) and the volumes it makes."""

    image_dir: Path | None
    image_pieces: dict[str, list[image_files.Piece]]
    image_meta: dict[str, Any]  # a pulled image's image.json (checked)
    volumes: list[dict[str, Any]]


@dataclass
class _Made:
    """What a pull made outside its staging directory: removed again if it fails."""

    volumes: list[str] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)

    def remove(self, store: VolumeStore) -> None:
        for name in self.volumes:
            with contextlib.suppress(Exception):
                store.remove(name)
        for image_dir in self.images:
            shutil.rmtree(image_dir, ignore_errors=True)


def _check_room(root: Path, remote: Remote, other_bytes: int, reserve: int) -> None:
    """The most a pull can write (its memory, device state, image and volumes, all
    allocated) must fit on the disk, with the reserve left: a registry's claim of a huge
    image or volume is refused before anything is written (507)."""
    vmstate = sum(la.length for la in remote.manifest.of_part("vmstate"))
    need = remote.memory_bytes + vmstate + other_bytes
    free = free_bytes(root) - reserve
    if need > free:
        raise NoRoom(
            f"pulling {remote.where} may need {need >> 20} MiB on disk and "
            f"{max(free, 0) >> 20} MiB are free (beside a {reserve >> 20} MiB reserve, "
            "--disk-reserve)"
        )
