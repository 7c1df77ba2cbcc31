"""The blob cache images are imported into: one file per blob, named by its sha256 digest.

``<root>/sha256/<hex>`` holds a blob whose content was checked against ``<hex>``
before it was put there; nothing else is ever written under that name. A blob
is written to a temporary file of its own in ``<root>/tmp/`` (created with
``O_EXCL``: two imports of the same blob at once each write their own), fsynced,
checked against its digest and size, and renamed into place: a second writer
of the same blob renames identical bytes over the first, and a reader never
sees half a blob. A blob refused (a wrong digest, too long or too short, the
disk full) leaves nothing behind.

The store holds blobs of images already imported or being imported; which
ones an image needs is the caller's to say (:meth:`BlobStore.remove_unreferenced`).
An import in progress works through :meth:`BlobStore.held`: every blob it looks
at or writes is kept from removal until it is done, so imports and removals run
side by side without a lock between them (a blob is looked for and held, or
removed, under one short lock: never removed between an import finding it and
using it).

Several daemons (and CLIs) on one host may share the store. An import's holds are
written to a file of its own, ``<root>/holds/@PID.TICKS.<random>``, one digest a
line, before the blob is looked for; a removal, in any process, keeps what a live
process's hold file names (a dead one's file is removed). The short lock is a
``flock`` on ``<root>/holds/.lock`` (shared to look and hold, exclusive to remove
or let go), taken after the in-process locks and before ``_HELD_LOCK``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

from forkd import file_lock, processes
from forkd.disk_reserve import DiskReserve, WriteMeter
from forkd.errors import ForkdError, Invalid, StorageFull
from forkd.oci.reference import DIGEST

STALE_TEMP_SECS = 24 * 3600  # a temporary file this old belongs to no live import
# Blobs held by imports in progress, by store root: digest -> how many imports hold it.
# One lock for finding-and-holding and for removing.
_HELD: dict[str, Counter[str]] = {}
_HELD_LOCK = threading.Lock()
# Held by a removal while it works out what to keep and removes the rest, and by an
# import while it lets its blobs go: an import's image is recorded before it lets go,
# so a removal either sees its hold or reads its record, never neither.
_COLLECTING = threading.Lock()


class _Hold:
    """The blobs one import holds (see :meth:`BlobStore.held`), in this process's
    table and in a hold file other processes read."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.digests: set[str] = set()
        self._file: Path | None = None

    def add(self, digest: str) -> None:  # under the store's lock (shared) and _HELD_LOCK
        if digest not in self.digests:
            self._record(digest)
            self.digests.add(digest)
            _HELD.setdefault(self.root, Counter())[digest] += 1

    def _record(self, digest: str) -> None:
        if self._file is None:
            holds = Path(self.root) / HOLDS
            holds.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._file = holds / f"{processes.mark()}{secrets.token_hex(8)}"
        try:
            fd = os.open(self._file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, f"{digest}\n".encode())
            finally:
                os.close(fd)
        except OSError as exc:
            raise write_error(exc) from exc

    def release(self) -> None:
        with _COLLECTING, file_lock.locked(_lock_file(self.root)), _HELD_LOCK:
            held = _HELD.get(self.root, Counter())
            held.subtract(self.digests)
            for digest in self.digests:
                if held[digest] <= 0:
                    del held[digest]
            if not held:
                _HELD.pop(self.root, None)
            self.digests.clear()
            if self._file is not None:
                self._file.unlink(missing_ok=True)
                self._file = None


HOLDS = "holds"  # <root>/holds/: each import's hold file, and the store's lock


def _lock_file(root: str | Path) -> Path:
    return Path(root) / HOLDS / ".lock"


def held_elsewhere(root: Path) -> set[str]:
    """The digests other processes' imports hold (their hold files; a file whose process
    is gone is removed). Call it under the store's lock, held exclusively."""
    me = processes.Holder.of(os.getpid())
    held: set[str] = set()
    for holder, path in processes.live_marked_files(root / HOLDS):
        if holder == me:
            continue
        with contextlib.suppress(OSError, UnicodeDecodeError):
            held.update(d for d in path.read_text().split() if DIGEST.fullmatch(d))
    return held


class BlobStore:
    """Blobs by digest under ``root`` (created when first written)."""

    def __init__(
        self, root: Path, *, reserve: DiskReserve | None = None, _hold: _Hold | None = None
    ) -> None:
        self.root = Path(root)
        self.reserve = reserve  # what a blob may not take the disk under
        self.blobs_dir = self.root / "sha256"
        self.tmp_dir = self.root / "tmp"
        self.diff_ids_dir = self.root / "diff_ids"  # <hex>: the tar blob <hex> was checked to hold
        self._hold = _hold

    @contextlib.contextmanager
    def held(self) -> Iterator[BlobStore]:
        """The store, for an import: every blob looked for or written through it is kept
        from :meth:`remove` and :meth:`remove_unreferenced` until the block ends."""
        hold = _Hold(self._hold_key())
        try:
            yield BlobStore(self.root, reserve=self.reserve, _hold=hold)
        finally:
            hold.release()

    def _hold_key(self) -> str:
        return str(self.root.absolute())

    # ------------------------------------------------------------ reading

    def path(self, digest: str) -> Path | None:
        """Where the blob ``digest`` is, or None when the store does not hold it."""
        path = self._file(digest)
        with self._holding():
            if self._hold is not None:
                self._hold.add(digest)  # before it is looked for: then it stays
            try:
                return path if path.is_file() and not path.is_symlink() else None
            except OSError:
                return None

    @contextlib.contextmanager
    def _holding(self) -> Iterator[None]:
        """The lock to look for and hold a blob under (shared with other imports, in
        any process; a removal waits), when this store holds what it looks at."""
        if self._hold is None:
            with _HELD_LOCK:
                yield
            return
        with file_lock.locked(_lock_file(self.root), shared=True), _HELD_LOCK:
            yield

    def has(self, digest: str) -> bool:
        return self.path(digest) is not None

    def size(self, digest: str) -> int | None:
        path = self.path(digest)
        return None if path is None else path.stat().st_size

    def read(self, digest: str, limit: int) -> bytes | None:
        """The blob's bytes when it is held and at most ``limit`` bytes long, else None."""
        path = self.path(digest)
        if path is None:
            return None
        with path.open("rb") as f:
            data = f.read(limit + 1)
        return data if len(data) <= limit else None

    def digests(self) -> Iterator[str]:
        """The digest of every blob held."""
        try:
            names = os.listdir(self.blobs_dir)
        except FileNotFoundError:
            return
        for name in names:
            digest = f"sha256:{name}"
            if DIGEST.fullmatch(digest):
                yield digest

    def total_bytes(self) -> int:
        """The sizes of the blobs held, summed."""
        total = 0
        for digest in self.digests():
            with contextlib.suppress(FileNotFoundError):
                total += (self.blobs_dir / digest[7:]).stat().st_size
        return total

    def is_verified(self, digest: str, diff_id: str) -> bool:
        """Whether the layer blob ``digest`` was checked to hold the tar ``diff_id``."""
        self._file(digest)
        try:
            return (self.diff_ids_dir / digest[7:]).read_text() == diff_id
        except (OSError, UnicodeDecodeError):
            return False

    # ------------------------------------------------------------ writing

    def mark_verified(self, digest: str, diff_id: str) -> None:
        """Remember that the layer blob ``digest`` holds the tar ``diff_id`` (checked by
        the caller: a blob has one tar, so this is said once)."""
        self._file(digest)
        self._file(diff_id)
        self.diff_ids_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = self.temp_file(".diff_id")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(diff_id)
            os.replace(tmp, self.diff_ids_dir / digest[7:])
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise write_error(exc) from exc

    def writer(
        self, digest: str | None, size: int, *, error: type[ForkdError] = Invalid
    ) -> BlobWriter:
        """A writer of one blob of exactly ``size`` bytes whose sha256 must be ``digest``
        (None: whatever it turns out to be); ``error`` is what a blob that breaks either
        raises. Use it as a context manager and call :meth:`BlobWriter.commit`."""
        if digest is not None:
            self._file(digest)  # checks its syntax
        if size < 0:
            raise Invalid(f"a blob cannot be {size} bytes long")
        return BlobWriter(self, digest, size, error)

    def put(
        self, data: bytes, digest: str | None = None, *, error: type[ForkdError] = Invalid
    ) -> str:
        """Store ``data`` (checked against ``digest`` when given); its digest."""
        with self.writer(digest, len(data), error=error) as w:
            w.write(data)
            return w.commit()[0]

    def remove(self, digests: set[str]) -> int:
        """Remove the blobs ``digests`` the store holds but no import in progress (of
        any process) holds; the bytes freed."""
        with file_lock.locked(_lock_file(self.root)):
            return self._remove(digests)

    def _remove(self, digests: set[str]) -> int:  # under the store's lock, exclusive
        freed = 0
        elsewhere = held_elsewhere(self.root)
        for digest in digests:
            path = self._file(digest)
            with _HELD_LOCK:
                if digest in elsewhere or _HELD.get(self._hold_key(), Counter())[digest] > 0:
                    continue  # an import in progress holds it
                with contextlib.suppress(FileNotFoundError):
                    (self.diff_ids_dir / digest[7:]).unlink()
                with contextlib.suppress(FileNotFoundError):
                    size = path.stat().st_size
                    path.unlink()
                    freed += size
        return freed

    def looked_at(self) -> set[str]:
        """The digests looked at or written through this store (of :meth:`held`)."""
        return set(self._hold.digests) if self._hold is not None else set()

    def held_by_imports(self) -> set[str]:
        """The digests imports in progress hold."""
        with _HELD_LOCK:
            return {d for d, n in _HELD.get(self._hold_key(), Counter()).items() if n > 0}

    def remove_unreferenced(
        self, keep: set[str] | Callable[[], set[str]], among: set[str] | None = None
    ) -> int:
        """Remove every blob (of ``among``, when given) not in ``keep`` and held by no
        import in progress (and temporary files no import can still be writing); the
        bytes freed. ``keep`` may be a function, called when no import can let its blobs
        go until this is done: an import records its image (which ``keep`` then names)
        before it lets go, so its blobs are kept either way."""
        with _COLLECTING, file_lock.locked(_lock_file(self.root)):
            kept = keep() if callable(keep) else keep
            freed = self._remove((set(self.digests()) if among is None else among) - kept)
        if among is not None:
            return freed
        try:
            names = os.listdir(self.tmp_dir)
        except FileNotFoundError:
            names = []
        cutoff = time.time() - STALE_TEMP_SECS
        for name in names:
            path = self.tmp_dir / name
            with contextlib.suppress(FileNotFoundError):
                st = path.lstat()
                if st.st_mtime < cutoff:
                    path.unlink()
                    freed += st.st_size
        return freed

    def temp_file(self, suffix: str) -> tuple[int, Path]:
        """A new empty file of the store's (descriptor and path), for data on its way in:
        remove it when done."""
        self.tmp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.blobs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for _ in range(16):
            path = self.tmp_dir / f"{processes.mark()}{secrets.token_hex(8)}{suffix}"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            return fd, path
        raise ForkdError(f"no free temporary name in the blob store {self.tmp_dir}")

    def _file(self, digest: str) -> Path:
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise Invalid(f"not a sha256 digest: {str(digest)[:80]!r}")
        return self.blobs_dir / digest[7:]


class BlobWriter:
    """One blob on its way into the store: written, then checked and renamed into place
    by :meth:`commit`; closed without a commit (or refused), it leaves nothing."""

    def __init__(
        self, store: BlobStore, digest: str | None, size: int, error: type[ForkdError]
    ) -> None:
        self.store, self.digest, self.size, self.error = store, digest, size, error
        self.written = 0
        self._hash = hashlib.sha256()
        self._fd: int | None = None
        self._path: Path | None = None
        self._meter: WriteMeter | None = None

    def __enter__(self) -> BlobWriter:
        if self.store.reserve is not None:  # a stated size that does not fit: not a byte
            self._meter = self.store.reserve.meter(f"storing {self._what()}", self.size)
        self._fd, self._path = self.store.temp_file(".blob")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._discard()

    def write(self, data: bytes | memoryview) -> None:
        if self._fd is None:
            raise RuntimeError("BlobWriter used outside its with block")
        if self.written + len(data) > self.size:
            raise self.error(f"{self._what()} is longer than its {self.size} bytes: refused")
        if self._meter is not None:
            self._meter.will_write(len(data))
        self._hash.update(data)
        self.written += len(data)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise write_error(exc) from exc

    def commit(self) -> tuple[str, Path]:
        """Check the blob and rename it into place; its digest and path in the store."""
        if self._fd is None or self._path is None:
            raise RuntimeError("BlobWriter committed outside its with block")
        digest = self.check()
        final = self.store.blobs_dir / digest[7:]
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            with self.store._holding():
                if self.store._hold is not None:
                    self.store._hold.add(digest)
                os.replace(self._path, final)  # the same bytes as any other writer's
            self._path = None
            _fsync_dir(self.store.blobs_dir)
        except OSError as exc:
            raise write_error(exc) from exc
        return digest, final

    def check(self) -> str:
        """The blob's digest; ``error`` when what was written is not the stated size or
        digest."""
        digest = "sha256:" + self._hash.hexdigest()
        if self.written != self.size:
            raise self.error(
                f"{self._what()} has {self.written} bytes where {self.size} were stated: refused"
            )
        if self.digest is not None and digest != self.digest:
            raise self.error(f"{self._what()} has the digest {digest}: refused")
        return digest

    def _what(self) -> str:
        return f"blob {self.digest}" if self.digest else "a blob"

    def _discard(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            self._path = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(exc: OSError) -> ForkdError:
    """The error a failed write into the store is reported as (a full disk says so)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull("the disk of the blob store filled up: the blob was not kept")
    return ForkdError(f"writing to the blob store failed: {exc.strerror or exc}")
