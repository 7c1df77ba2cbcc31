"""Images from files on the daemon's host: an OCI layout directory, an OCI archive, a
``docker save`` archive (from a file, or exported by the local Docker Engine).

Archives are never unpacked: :class:`TarFiles` reads one once through
:class:`forkd.archive.tar_format.TarReader` (bounded) and notes where each
member's bytes lie; a blob is then read from there straight into the store,
checked. A layout directory is read one component at a time with
``O_NOFOLLOW`` (:class:`DirFiles`): a symlink anywhere under it is refused, so
nothing outside the directory is ever read through it. An OCI blob is checked
against its descriptor's digest and size; a ``docker save`` archive's image is
read by :mod:`forkd.image_import.docker_archive`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from forkd.archive import ArchiveError, Limits
from forkd.archive.tar_format import Kind, TarReader
from forkd.errors import Invalid, NotFound
from forkd.image_import import manifests, references
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.diff_ids import LayerMismatch
from forkd.image_import.fetch import LAYER_CAP, Say, import_manifest
from forkd.image_import.manifests import Descriptor, ImageIndex
from forkd.image_import.model import FetchedImage

PIECE = 1 << 20
PROGRESS_SECS = 2.0  # an export's progress: at most a line this often
MAX_LINK_HOPS = 8  # symlinks and hard links between members followed to find a file
ARCHIVE_LIMITS = Limits(
    max_entries=1 << 16,
    max_bytes=1 << 40,
    max_header_bytes=64 << 10,
    max_path_bytes=4096,
    max_depth=64,
)
_COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"\xfd7zXZ": "xz",
    b"BZh": "bzip2",
}


def fetch(
    source: references.ImageSource,
    store: BlobStore,
    say: Say,
    *,
    docker_host: str | None,
    layer_cap: int = LAYER_CAP,
) -> FetchedImage:
    """The image a reference of a file, a directory or the Docker Engine names."""
    reference = str(source)
    if isinstance(source, (references.OciLayout, references.OciArchive)):
        opened = DirFiles if isinstance(source, references.OciLayout) else TarFiles
        with opened(source.path) as files:
            layout = LayoutSource(files, source.tag, reference)
            return import_manifest(layout, store, reference, say, layer_cap=layer_cap)
    if isinstance(source, references.DockerArchive):
        from forkd.image_import.docker_archive import import_docker_archive

        with TarFiles(source.path) as files:
            return import_docker_archive(
                files, source.tag, store, reference, say, layer_cap=layer_cap
            )
    if isinstance(source, references.DaemonImage):
        return _from_engine(source, store, say, docker_host, layer_cap)
    raise Invalid(f"{reference} is not an image on this host")


def fetch_loaded(
    path: Path,
    tag: str | None,
    store: BlobStore,
    say: Say,
    *,
    shown: str,
    layer_cap: int = LAYER_CAP,
) -> FetchedImage:
    """The image of an archive a client sent (``POST /v1/images/load``): a ``docker save``
    archive or an OCI archive, told apart by what it holds (``manifest.json``, or
    ``oci-layout``; a ``docker save`` of Docker 25 holds both and reads as either).

    ``tag`` picks one image of several; an archive of one image is that image whatever
    ``tag`` says (Podman writes ``localhost/app:1`` where Docker writes ``app:1``)."""
    from forkd.image_import.docker_archive import import_docker_archive

    with TarFiles(path, shown=shown) as files:

        def load(chosen: str | None) -> FetchedImage:
            if files.has("manifest.json"):
                return import_docker_archive(files, chosen, store, shown, say, layer_cap=layer_cap)
            if files.has("oci-layout") and files.has("index.json"):
                layout = LayoutSource(files, chosen, shown)
                return import_manifest(layout, store, shown, say, layer_cap=layer_cap)
            raise Invalid(
                f"{shown} is neither a docker save archive (no manifest.json) nor an OCI "
                "archive (no oci-layout and index.json)"
            )

        try:
            return load(tag)
        except NotFound as missing:
            if tag is None:
                raise
            try:
                return load(None)
            except LayerMismatch:
                raise  # the one image it holds is not what its config says
            except Invalid:
                raise missing from None


def _from_engine(
    source: references.DaemonImage,
    store: BlobStore,
    say: Say,
    docker_host: str | None,
    layer_cap: int,
) -> FetchedImage:
    from forkd.image_import import docker_engine
    from forkd.image_import.docker_archive import from_held, import_docker_archive

    image_id = docker_engine.image_id(source.image, docker_host=docker_host)
    held = from_held(store, image_id, str(source))
    if held is not None:
        say(f"{source.image} ({image_id[7:19]}) was imported before: nothing to export")
        return held
    fd, saved = store.temp_file(".docker-save.tar")
    os.close(fd)
    try:
        say(f"exporting {source.image} from the Docker Engine")
        docker_engine.save(
            source.image,
            saved,
            docker_host=docker_host,
            progress=every_few_seconds(lambda n: say(f"exported {n / (1 << 20):.1f} MiB")),
        )
        with TarFiles(saved, shown=str(source)) as files:
            return import_docker_archive(files, None, store, str(source), say, layer_cap=layer_cap)
    finally:
        saved.unlink(missing_ok=True)


def every_few_seconds(
    report: Callable[[int], None], seconds: float = PROGRESS_SECS
) -> Callable[[int], None]:
    """``report`` for a count that grows by the chunk, called at most once per ``seconds``
    (a 200 MiB export is a few lines in a log, not 200)."""
    last = [time.monotonic()]

    def maybe(count: int) -> None:
        now = time.monotonic()
        if now - last[0] >= seconds:
            last[0] = now
            report(count)

    return maybe


# ---------------------------------------------------------------------- files


class Files(Protocol):
    what: str

    def open(self, name: str) -> contextlib.AbstractContextManager[tuple[int, Iterator[bytes]]]:
        """A file's size and its bytes in pieces; :class:`Invalid` if it is missing."""
        ...


def read_small(files: Files, name: str, limit: int = manifests.MAX_DOCUMENT_BYTES) -> bytes:
    with files.open(name) as (size, chunks):
        if size > limit:
            raise Invalid(f"{files.what}: {name} is {size} bytes, more than the {limit} read")
        return b"".join(chunks)


class TarFiles:
    """The regular files of a tar archive, found by name without unpacking it."""

    def __init__(self, path: Path, shown: str | None = None) -> None:
        self.what = shown or f"archive {path}"
        self._fd = _open_regular(path, self.what)
        self._files: dict[str, tuple[int, int] | None] = {}  # None: stored sparse
        self._links: dict[str, str] = {}
        try:
            self._index()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> TarFiles:
        return self

    def __exit__(self, *_: object) -> None:
        os.close(self._fd)

    def _index(self) -> None:
        head = os.pread(self._fd, 8, 0)
        for magic, kind in _COMPRESSED.items():
            if head.startswith(magic):
                raise Invalid(
                    f"{self.what} is {kind}-compressed: decompress it first (forkd reads "
                    "image archives as plain tar, as docker save writes them)"
                )
        stream = os.fdopen(os.dup(self._fd), "rb", buffering=PIECE)
        with stream:
            reader = TarReader(stream.read, ARCHIVE_LIMITS)
            try:
                for member in reader:
                    self._note(
                        member.name,
                        member.kind,
                        member.linkname,
                        reader.stream,
                        member.size,
                        member.sparse is not None,
                    )
            except ArchiveError as exc:
                raise Invalid(f"{self.what} is not a tar archive forkd reads: {exc}") from None

    def _note(self, name: str, kind: Kind, link: str, offset: int, size: int, sparse: bool) -> None:
        key = _norm(name)
        if key is None or kind not in (Kind.FILE, Kind.SYMLINK, Kind.HARDLINK):
            return
        if key in self._files or key in self._links:
            raise Invalid(f"{self.what} holds {key!r} twice: refused as ambiguous")
        if kind is Kind.FILE:
            self._files[key] = None if sparse else (offset, size)
        elif kind is Kind.SYMLINK and not link.startswith("/"):
            target = _norm(posixpath.join(posixpath.dirname(key), link))
            if target is not None:
                self._links[key] = target
        elif kind is Kind.HARDLINK and (target := _norm(link)) is not None:
            self._links[key] = target

    def has(self, name: str) -> bool:
        key = _norm(name)
        return key is not None and (key in self._files or key in self._links)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[tuple[int, Iterator[bytes]]]:
        key = _norm(name)
        for _ in range(MAX_LINK_HOPS):
            if key is None or key not in self._links:
                break
            key = self._links[key]
        if key is None or key not in self._files:
            raise Invalid(f"{self.what} has no file {name!r}")
        place = self._files[key]
        if place is None:
            raise Invalid(f"{self.what} stores {name!r} as a sparse file: refused")
        offset, size = place
        yield size, self._chunks(offset, size, name)

    def _chunks(self, offset: int, size: int, name: str) -> Iterator[bytes]:
        end = offset + size
        while offset < end:
            try:
                piece = os.pread(self._fd, min(PIECE, end - offset), offset)
            except OSError as exc:
                raise Invalid(f"{self.what} cannot be read ({exc.strerror})") from None
            if not piece:
                raise Invalid(f"{self.what} ends in the middle of {name!r}")
            offset += len(piece)
            yield piece


class DirFiles:
    """The files of a directory, each reached without following a symlink."""

    def __init__(self, path: Path) -> None:
        self.what = f"OCI layout {path}"
        try:
            self._root = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"there is no directory {path}") from None
        except NotADirectoryError:
            raise Invalid(f"{path} is not a directory (an OCI layout is one)") from None
        except PermissionError:
            raise Invalid(f"{path} cannot be read (permission denied)") from None

    def __enter__(self) -> DirFiles:
        return self

    def __exit__(self, *_: object) -> None:
        os.close(self._root)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[tuple[int, Iterator[bytes]]]:
        parts = name.split("/")
        fd = os.dup(self._root)
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                flags |= os.O_NONBLOCK if last else os.O_DIRECTORY  # a fifo never blocks
                try:
                    nxt = os.open(part, flags, dir_fd=fd)
                except OSError as exc:
                    raise self._refused(name, exc) from None
                os.close(fd)
                fd = nxt
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Invalid(f"{self.what}: {name} is not a regular file")
            yield st.st_size, _read_fd(fd, st.st_size, self.what, name)
        finally:
            os.close(fd)

    def _refused(self, name: str, exc: OSError) -> Invalid:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return Invalid(f"{self.what}: {name} is reached through a symlink: refused")
        if exc.errno == errno.ENOENT:
            return Invalid(f"{self.what} has no file {name}")
        return Invalid(f"{self.what}: {name} cannot be read ({exc.strerror})")


def _read_fd(fd: int, size: int, what: str, name: str) -> Iterator[bytes]:
    left = size
    while left:
        piece = os.read(fd, min(PIECE, left))
        if not piece:
            raise Invalid(f"{what}: {name} was cut short while read")
        left -= len(piece)
        yield piece


def _open_regular(path: Path, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFound(f"{what} does not exist") from None
    except PermissionError:
        raise Invalid(f"{what} cannot be read (permission denied)") from None
    except OSError as exc:
        raise Invalid(f"{what} cannot be opened ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Invalid(f"{what} is not a regular file")
    return fd


def _norm(name: str) -> str | None:
    """A member's name as looked up: relative, ``./`` and ``//`` gone; None for one that
    is absolute or climbs out."""
    if not name or name.startswith("/") or "\0" in name:
        return None
    norm = posixpath.normpath(name)
    return None if norm == ".." or norm.startswith("../") or norm == "." else norm


def blob_name(digest: str) -> str:
    return f"blobs/sha256/{digest[7:]}"


# ---------------------------------------------------------------------- OCI layouts


def layout_index(files: Files, shown: str) -> ImageIndex:
    """The ``index.json`` of the OCI image layout in ``files`` (``oci-layout`` checked
    first); :class:`Invalid` naming ``shown`` when it is not one."""
    try:
        layout = manifests.load_json(read_small(files, "oci-layout", 4096), "oci-layout")
    except Invalid as exc:
        raise Invalid(f"{shown} is not an OCI image layout: {exc}") from None
    if not isinstance(layout, dict) or not isinstance(layout.get("imageLayoutVersion"), str):
        raise Invalid(f"{shown} has a malformed oci-layout file")
    what = f"the index.json of {shown}"
    index = manifests.parse_manifest(read_small(files, "index.json"), manifests.OCI_INDEX, what)
    if not isinstance(index, ImageIndex):
        raise Invalid(f"{what} is not an image index")
    return index


class LayoutSource:
    """An OCI image layout (``oci-layout``, ``index.json``, ``blobs/``), in a directory
    or an archive; the image its index tags ``tag`` (or its only one)."""

    error = Invalid

    def __init__(self, files: Files, tag: str | None, reference: str) -> None:
        self.files, self.tag, self.reference = files, tag, reference

    def top(self) -> tuple[bytes, str, str]:
        desc = self._choose(layout_index(self.files, self.reference))
        return self.read(desc), desc.digest, desc.media_type

    def _choose(self, index: ImageIndex) -> Descriptor:
        found = list(index.manifests)
        tags = sorted({d.ref_name for d in found if d.ref_name})
        if self.tag is not None:
            found = [d for d in found if d.ref_name == self.tag]
            if not found:
                raise NotFound(
                    f"{self.reference}: no image tagged {self.tag!r} in the layout (tags: "
                    f"{', '.join(tags[:20]) or 'none'})"
                )
        if len(found) == 1:
            return found[0]
        if found and all(d.platform for d in found):
            return manifests.pick_platform(
                ImageIndex(index.media_type, tuple(found)), self.reference
            )
        raise Invalid(
            f"{self.reference} holds {len(found)} images: name one with :TAG (tags: "
            f"{', '.join(tags[:20]) or 'none'})"
        )

    def read(self, desc: Descriptor) -> bytes:
        if desc.size > manifests.MAX_DOCUMENT_BYTES:
            raise Invalid(f"{self.reference}: blob {desc.digest} is too large for a manifest")
        data = b"".join(self._blob(desc))
        if "sha256:" + hashlib.sha256(data).hexdigest() != desc.digest:
            raise Invalid(f"{self.reference}: blob {desc.digest} does not match its digest")
        return data

    @contextlib.contextmanager
    def chunks(self, desc: Descriptor) -> Iterator[Iterator[bytes]]:
        yield self._blob(desc)

    def _blob(self, desc: Descriptor) -> Iterator[bytes]:
        with self.files.open(blob_name(desc.digest)) as (size, chunks):
            if size != desc.size:
                raise Invalid(
                    f"{self.reference}: blob {desc.digest} is {size} bytes where its "
                    f"descriptor says {desc.size}"
                )
            yield from chunks
