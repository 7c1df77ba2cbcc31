"""Getting an image from wherever its reference says into the blob store, every byte checked:
:func:`fetch_image`.

A registry, an OCI layout (a directory or an archive) and a ``docker save``
archive (from a file or from the Docker Engine) each answer the same few
questions (:class:`Source`): the manifest the reference names, a small blob,
a layer streamed. One flow (:func:`import_manifest`) then walks an index to
its linux/amd64 manifest, checks the manifest and its config, and copies into
the store only the blobs it lacks: a layer held already is not fetched again,
so a second import of an image reads its manifest alone and an image that
shares base layers with another reads only its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from forkd import import_deadline
from forkd.errors import ForkdError, Invalid, UpstreamError
from forkd.image_import import manifests, references
from forkd.image_import.blob_store import BlobStore, BlobWriter
from forkd.image_import.diff_ids import copy_checking_diff_id, file_chunks
from forkd.image_import.layers import layer_cap
from forkd.image_import.manifests import Descriptor, ImageIndex, ImageManifest
from forkd.image_import.model import FetchedImage, LayerBlob
from forkd.limits import MAX_IMAGE_BYTES
from forkd.oci import auth
from forkd.oci.policy import RegistryPolicy
from forkd.oci.registry import Registry

MAX_INDEX_HOPS = 2  # an index may name an index (an OCI layout's index.json, then a list)
PROGRESS_EVERY_BYTES = 16 << 20
PROGRESS_EVERY_SECS = 1.0
MIB = 1 << 20
# What one layer's tar may be, decompressed, when the caller does not say: as long as a
# tar within the default image limits can be.
LAYER_CAP = layer_cap(MAX_IMAGE_BYTES)

Say = Callable[[str], None]
CredentialsFor = Callable[[str], auth.Credentials | None]


def fetch_image(
    text: str,
    store: BlobStore,
    *,
    policy: RegistryPolicy,
    credentials_for: CredentialsFor = auth.from_docker_config,
    docker_host: str | None = None,
    progress: Say | None = None,
    layer_cap: int = LAYER_CAP,
) -> FetchedImage:
    """Fetch the image ``text`` names into ``store``, checked; what it holds and what the
    import read. Raises :class:`Invalid` (a malformed reference or image),
    :class:`NotFound` (no such image, repository, tag or file), ``UpstreamRefused``
    (credentials), :class:`UpstreamError` (a registry unreachable or lying),
    :class:`Unavailable` (no Docker Engine); a failed import leaves nothing behind but
    whole, checked blobs. Every layer's tar is checked against the config's diff_id
    (at most ``layer_cap`` bytes of it)."""
    say: Say = progress or (lambda _msg: None)
    source = references.parse(text, policy)
    if isinstance(source, references.RegistryImage):
        ref = source.ref
        with Registry(ref, policy=policy, credentials=credentials_for(ref.registry)) as reg:
            return import_manifest(
                RegistrySource(reg), store, str(source), say, layer_cap=layer_cap
            )
    from forkd.image_import import local_sources  # files on this host, and the Docker Engine

    return local_sources.fetch(source, store, say, docker_host=docker_host, layer_cap=layer_cap)


class Source(Protocol):
    """Where an image's manifests and blobs are read from."""

    @property
    def error(self) -> type[ForkdError]:
        """What a blob that is not what its descriptor says raises: a registry's lie is
        UpstreamError (502), a file's is Invalid (400)."""
        ...

    def top(self) -> tuple[bytes, str, str]:
        """The manifest or index the reference names: bytes, digest, media type ("" if
        the source does not say)."""
        ...

    def read(self, desc: Descriptor) -> bytes:
        """A small blob (a manifest, a config), checked against ``desc``."""
        ...

    def chunks(self, desc: Descriptor) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        """A blob piece by piece, checked against ``desc`` once all are read."""
        ...


class RegistrySource:
    error = UpstreamError

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def top(self) -> tuple[bytes, str, str]:
        return self.registry.get_image_manifest(self.registry.ref.reference)

    def read(self, desc: Descriptor) -> bytes:
        if desc.media_type in manifests.ACCEPTED:
            data, _, _ = self.registry.get_image_manifest(desc.digest)  # checked by digest
            if len(data) != desc.size:
                raise UpstreamError(
                    f"registry {self.registry.ref.registry} sent manifest {desc.digest} "
                    f"of {len(data)} bytes where {desc.size} were stated: refusing it"
                )
            return data
        return self.registry.get_blob(desc.digest, desc.size)

    def chunks(self, desc: Descriptor) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        return self.registry.blob_chunks(desc.digest, desc.size)


def import_manifest(
    source: Source, store: BlobStore, reference: str, say: Say, *, layer_cap: int = LAYER_CAP
) -> FetchedImage:
    """The image the source's reference names, into ``store``: its index walked to the
    linux/amd64 manifest, that manifest, its config and its layers checked and stored
    (each layer's tar against the config's diff_id, at most ``layer_cap`` bytes)."""
    say("manifest")
    data, digest, media_type = source.top()
    fetched = len(data)
    what = f"the manifest of {reference}"
    doc = manifests.parse_manifest(data, media_type, what)
    for _ in range(MAX_INDEX_HOPS + 1):
        if not isinstance(doc, ImageIndex):
            break
        desc = manifests.pick_platform(doc, what)
        data, digest = source.read(desc), desc.digest
        fetched += len(data)
        what = f"manifest {desc.digest} of {reference}"
        doc = manifests.parse_manifest(data, desc.media_type, what)
    if not isinstance(doc, ImageManifest):
        raise Invalid(f"{reference} names indexes more than {MAX_INDEX_HOPS} deep")
    config_data = store.read(doc.config.digest, manifests.MAX_DOCUMENT_BYTES)
    config_held = config_data is not None and len(config_data) == doc.config.size
    reused = 0
    if config_data is None or not config_held:
        say("config")
        config_data = source.read(doc.config)
        fetched += len(config_data)
    else:
        reused += len(config_data)
    parsed = manifests.parse_config(config_data, len(doc.layers), f"the config of {reference}")
    layers, layer_fetched, layer_reused = copy_layers(
        source, store, doc.layers, parsed.diff_ids, say, layer_cap=layer_cap
    )
    # Kept last: a manifest in the store is one whose config and layers are there too.
    if not config_held:
        store.put(config_data, doc.config.digest, error=source.error)
    if not store.has(digest):
        store.put(data, digest, error=source.error)
    return FetchedImage(
        reference=reference,
        manifest_digest=digest,
        config_digest=doc.config.digest,
        config=parsed.config,
        layers=layers,
        bytes_fetched=fetched + layer_fetched,
        bytes_reused=reused + layer_reused,
    )


def copy_layers(
    source: Source,
    store: BlobStore,
    descs: tuple[Descriptor, ...],
    diff_ids: tuple[str, ...],
    say: Say,
    *,
    layer_cap: int,
) -> tuple[tuple[LayerBlob, ...], int, int]:
    """Each layer the store lacks copied into it, every one checked against its diff_id
    (a held one once, then remembered); the layers, bytes fetched, bytes reused."""
    layers: list[LayerBlob] = []
    fetched = reused = 0
    for i, (desc, diff_id) in enumerate(zip(descs, diff_ids, strict=True), 1):
        label = f"layer {i}/{len(descs)} {short_digest(desc.digest)}"
        what = f"layer {i}/{len(descs)} ({desc.digest})"
        held = store.path(desc.digest)
        if held is not None and held.stat().st_size == desc.size:
            if not store.is_verified(desc.digest, diff_id):
                say(f"{label} cached: checking it against the config")
                check_held(store, held, desc.digest, diff_id, what, layer_cap)
            say(f"{label} cached ({desc.size / MIB:.1f} MiB)")
            reused += desc.size
        else:
            with store.writer(desc.digest, desc.size, error=source.error) as w:
                with source.chunks(desc) as chunks:
                    try:
                        copy_checking_diff_id(
                            chunks, Meter(w, label, say).write, diff_id, what, cap=layer_cap
                        )
                    except Invalid:
                        if w.written == w.size:  # read whole: one not its digest says so
                            w.check()
                        raise
                _, held = w.commit()
            store.mark_verified(desc.digest, diff_id)
            fetched += desc.size
        layers.append(LayerBlob(desc.digest, desc.size, desc.media_type, held, diff_id))
    return tuple(layers), fetched, reused


def check_held(
    store: BlobStore, held: Path, digest: str, diff_id: str, what: str, cap: int
) -> None:
    """Check a blob the store holds against ``diff_id`` (it was kept by another image's
    import, whose config may have said otherwise) and remember it was."""
    copy_checking_diff_id(file_chunks(held), lambda _piece: None, diff_id, what, cap=cap)
    store.mark_verified(digest, diff_id)


class Meter:
    """A blob writer that says how far it got, every few MiB or seconds and at the end."""

    def __init__(self, writer: BlobWriter, label: str, say: Say) -> None:
        self.writer, self.label, self.say = writer, label, say
        self._said_bytes, self._said_at = 0, time.monotonic()
        say(self._line())

    def write(self, data: bytes) -> None:
        import_deadline.check()
        self.writer.write(data)
        now = time.monotonic()
        done = self.writer.written
        if (
            done == self.writer.size
            or done - self._said_bytes >= PROGRESS_EVERY_BYTES
            or now - self._said_at >= PROGRESS_EVERY_SECS
        ):
            self._said_bytes, self._said_at = done, now
            self.say(self._line())

    def _line(self) -> str:
        w = self.writer
        if w.size < MIB:
            return f"{self.label} {w.written / 1024:.1f}/{w.size / 1024:.1f} KiB"
        return f"{self.label} {w.written / MIB:.1f}/{w.size / MIB:.1f} MiB"


def short_digest(digest: str) -> str:
    return digest[:19] + "…"
