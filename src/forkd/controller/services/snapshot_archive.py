"""Snapshots as OCI archives on disk: the original forkd's ``pack`` and ``unpack``.

An archive holds what a push sends a registry (:mod:`forkd.oci.push`: the image
files, the device state, the memory in pieces, a diff's bases as manifests of their
own), laid out as an OCI image layout (``oci-layout``, ``index.json``,
``blobs/sha256/<hex>``) and tarred. :class:`ArchiveWriter` stands for the registry a
push writes to, appending each blob to the tar as it comes (one copy on disk, not a
directory and then a tar); :class:`ArchiveReader` stands for the registry a pull reads,
over the tar's members found by name and never unpacked
(:class:`~forkd.image_import.local_sources.TarFiles`). An archive is a client's
input like any registry's answer: every blob is checked against its digest and size
as it is read, ``index.json`` and manifests are bounded, and nothing is followed out
of the tar.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import tarfile
import time
from collections.abc import Iterator
from typing import IO, cast

from forkd.disk_reserve import WriteMeter
from forkd.errors import Invalid, NotFound
from forkd.image_import import manifests
from forkd.image_import.local_sources import TarFiles, layout_index
from forkd.oci.reference import DIGEST, Reference
from forkd.oci.registry import MANIFEST_BYTES_LIMIT, MANIFEST_TYPE

ARCHIVE_REGISTRY = "oci-archive"  # what messages and digest records name an archive by
REF_NAME = "org.opencontainers.image.ref.name"


def _ref(tag: str | None) -> Reference:
    return Reference(ARCHIVE_REGISTRY, "snapshot", tag)


class MeteredFile:
    """A file written through a :class:`~forkd.disk_reserve.WriteMeter`: a pack stops
    (507) once the disk is down to its reserve, rather than filling it under the VMs.
    What tarfile asks of a file to write into (``write``, ``tell``, ``flush``)."""

    def __init__(self, f: IO[bytes], meter: WriteMeter) -> None:
        self._f, self._meter = f, meter

    def write(self, data: bytes) -> int:
        self._meter.will_write(len(data))
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()


class ArchiveWriter:
    """A registry a push writes into a tar (``out``, a file open for writing)."""

    def __init__(self, out: IO[bytes] | MeteredFile, tag: str, mtime: int | None = None) -> None:
        self.ref = _ref(tag)
        # The blobs go in as the push makes them.
        self._tar = tarfile.open(  # noqa: SIM115 (closed by finish)
            fileobj=cast(IO[bytes], out), mode="w", format=tarfile.PAX_FORMAT
        )
        self._blobs: set[str] = set()
        self._tagged: dict[str, tuple[str, int]] = {}  # tag -> the manifest's digest, size
        self._mtime = int(time.time()) if mtime is None else mtime

    def close(self) -> None:
        """Nothing to let go (the push ends with :meth:`finish`)."""

    def has_blob(self, digest: str) -> bool:
        return digest in self._blobs

    def put_blob(self, data: bytes, digest: str) -> None:
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"a blob is not {digest}")
        if digest not in self._blobs:
            self._add(f"blobs/sha256/{digest[7:]}", data)
            self._blobs.add(digest)

    def put_manifest(self, body: bytes, reference: str) -> str:
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        self.put_blob(body, digest)
        if not reference.startswith("sha256:"):
            self._tagged[reference] = (digest, len(body))
        return digest

    def has_manifest(self, reference: str) -> bool:
        return reference in self._blobs or reference in self._tagged

    def finish(self) -> None:
        """Write ``oci-layout`` and ``index.json`` (the tagged manifests) and end the tar."""
        index = {
            "schemaVersion": 2,
            "mediaType": manifests.OCI_INDEX,
            "manifests": [
                {
                    "mediaType": MANIFEST_TYPE,
                    "digest": digest,
                    "size": size,
                    "annotations": {REF_NAME: tag},
                }
                for tag, (digest, size) in sorted(self._tagged.items())
            ],
        }
        self._add("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        self._add("index.json", json.dumps(index, sort_keys=True).encode())
        self._tar.close()

    def _add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, self._mtime
        self._tar.addfile(info, io.BytesIO(data))


class ArchiveReader:
    """A registry a pull reads from an archive's tar (``files``); ``shown`` in messages."""

    def __init__(self, files: TarFiles, shown: str) -> None:
        self.files, self.shown = files, shown
        self._index: dict[str, manifests.Descriptor] | None = None
        self.ref = _ref(None)

    def close(self) -> None:
        """The caller closes ``files``."""

    def tags(self) -> dict[str, manifests.Descriptor]:
        """The manifests ``index.json`` names, by tag (checked once)."""
        if self._index is None:
            index = layout_index(self.files, self.shown)
            self._index = {d.ref_name: d for d in index.manifests if d.ref_name}
        return self._index

    def only_tag(self) -> str:
        """The one tag the archive holds (a pack holds one; its bases go by digest)."""
        tags = sorted(self.tags())
        if len(tags) != 1:
            raise Invalid(f"{self.shown} names {len(tags)} snapshots: a pack names one")
        return tags[0]

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        if reference.startswith("sha256:"):
            digest, size = reference, MANIFEST_BYTES_LIMIT
            body = self._blob(digest, size, exact=False)
        else:
            desc = self.tags().get(reference)
            if desc is None:
                raise NotFound(f"{self.shown} holds no snapshot {reference!r}")
            if desc.media_type != MANIFEST_TYPE:
                raise Invalid(f"{self.shown}: {reference} is not a forkd snapshot")
            if desc.size > MANIFEST_BYTES_LIMIT:
                raise Invalid(f"{self.shown}: the manifest of {reference} is too large")
            digest = desc.digest
            body = self._blob(digest, desc.size, exact=True)
        return body, digest

    def has_manifest(self, reference: str) -> bool:
        if reference.startswith("sha256:"):
            return DIGEST.fullmatch(reference) is not None and self.files.has(_name(reference))
        return reference in self.tags()

    def get_blob(self, digest: str, size: int) -> bytes:
        return self._blob(digest, size, exact=True)

    @contextlib.contextmanager
    def blob_chunks(self, digest: str, size: int) -> Iterator[Iterator[bytes]]:
        yield iter([self._blob(digest, size, exact=True)])

    def _blob(self, digest: str, size: int, *, exact: bool) -> bytes:
        """The blob ``digest``: ``size`` bytes (at most, when not ``exact``), checked."""
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise Invalid(f"{self.shown}: {str(digest)[:80]!r} is not a sha256 digest")
        with self.files.open(_name(digest)) as (stored, chunks):
            if stored > size or (exact and stored != size):
                raise Invalid(f"{self.shown}: blob {digest} is {stored} bytes, not {size}")
            data = b"".join(chunks)
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise Invalid(f"{self.shown}: blob {digest} does not hold what its digest says")
        return data


def _name(digest: str) -> str:
    return f"blobs/sha256/{digest[7:]}"
