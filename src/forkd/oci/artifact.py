"""The wire format of a snapshot in a registry: an OCI image manifest of forkd's own types.

::

    manifest (application/vnd.oci.image.manifest.v1+json,
              artifactType application/vnd.forkd.snapshot.v1)
      config   application/vnd.forkd.snapshot.config.v1+json   what it is, what it needs
      layers   application/vnd.forkd.image.file.v1             the guest image's files, in
                                                               16 MiB pieces, uncompressed
               application/vnd.forkd.snapshot.vmstate.v1+zstd  QEMU's device state
               and its memory, one of two ways (the config's ``memory.encoding``):
               "chunks": application/vnd.forkd.snapshot.memory.chunk.v1+zstd
                         guest RAM in 1 MiB chunks at their offsets; all-zero
                         chunks (holes) are left out and read back as holes
               "delta":  application/vnd.forkd.snapshot.memory.runs.v1
                         the page runs that differ from the base manifest
                         (``memory.base``), and
                         application/vnd.forkd.snapshot.memory.pages.v1+zstd
                         those pages packed in run order, in 4 MiB pieces
               application/vnd.forkd.snapshot.volume.chunk.v1+zstd
                         each attached volume's disk at the snapshot, flattened
                         to raw, in 1 MiB chunks (part ``volume.N``)

Every piece is its own content-addressed blob, so a snapshot pushed after
its parent uploads only what changed, and the image once per repository.
Layer annotations place each piece: ``org.forkd.part`` (which file),
``org.forkd.offset`` and ``org.forkd.length`` (where, how long, uncompressed).
:func:`parse_manifest` and :func:`parse_config` check a registry's answer
against all of this before anything is fetched or written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from forkd.errors import UpstreamError
from forkd.oci.reference import DIGEST
from forkd.oci.registry import MANIFEST_TYPE

ARTIFACT_TYPE = "application/vnd.forkd.snapshot.v1"
CONFIG_TYPE = "application/vnd.forkd.snapshot.config.v1+json"
IMAGE_FILE_TYPE = "application/vnd.forkd.image.file.v1"
VMSTATE_TYPE = "application/vnd.forkd.snapshot.vmstate.v1+zstd"
CHUNK_TYPE = "application/vnd.forkd.snapshot.memory.chunk.v1+zstd"
RUNS_TYPE = "application/vnd.forkd.snapshot.memory.runs.v1"
PAGES_TYPE = "application/vnd.forkd.snapshot.memory.pages.v1+zstd"
VOLUME_TYPE = "application/vnd.forkd.snapshot.volume.chunk.v1+zstd"
LAYER_TYPES = (IMAGE_FILE_TYPE, VMSTATE_TYPE, CHUNK_TYPE, RUNS_TYPE, PAGES_TYPE, VOLUME_TYPE)
COMPRESSED_TYPES = (VMSTATE_TYPE, CHUNK_TYPE, PAGES_TYPE, VOLUME_TYPE)

PART, OFFSET, LENGTH = "org.forkd.part", "org.forkd.offset", "org.forkd.length"
CONFIG_FORMAT = 1
MEMORY_CHUNK = 1 << 20
PAGES_PIECE = 4 << 20
IMAGE_PIECE = 16 << 20
IMAGE_FILES = ("vmlinuz", "initrd.img", "rootfs.sqfs")
CONFIG_BYTES_LIMIT = 1 << 20
MAX_LAYERS = 20000
MAX_PIECE = 64 << 20  # no piece is longer, uncompressed; zstd adds little on top


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str
    size: int  # bytes in the registry (compressed, for the zstd types)
    part: str  # "vmstate", "memory", "runs", "pages", or an image file's name
    offset: int = 0  # where the piece goes in its file (for pages: in the packed stream)
    length: int = 0  # the piece's length, uncompressed

    def to_json(self) -> dict[str, Any]:
        return {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
            "annotations": {PART: self.part, OFFSET: str(self.offset), LENGTH: str(self.length)},
        }


@dataclass(frozen=True)
class Manifest:
    config_digest: str
    config_size: int
    layers: tuple[Layer, ...]
    annotations: dict[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "config": {
                "mediaType": CONFIG_TYPE,
                "digest": self.config_digest,
                "size": self.config_size,
            },
            "layers": [layer.to_json() for layer in self.layers],
        }
        if self.annotations:
            body["annotations"] = self.annotations
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def of_part(self, part: str) -> list[Layer]:
        return sorted((la for la in self.layers if la.part == part), key=lambda la: la.offset)


def check_placed(
    layers: list[Layer],
    media_type: str,
    what: str,
    *,
    limit: int | None = None,
    contiguous: bool = False,
    align: int = 1,
) -> int:
    """The pieces of one file, as a manifest places them (:meth:`Manifest.of_part`),
    checked: all of ``media_type``; offset and length multiples of ``align``; each after
    the one before (right after it when ``contiguous``, the first then at 0); none past
    ``limit``. :class:`UpstreamError` naming ``what`` otherwise; returns where the last
    ends."""
    end = 0
    for layer in layers:
        if layer.media_type != media_type:
            raise UpstreamError(f"{what} has a piece of type {layer.media_type}")
        if layer.offset % align or layer.length % align:
            raise UpstreamError(f"{what} has a piece off {align}-byte bounds")
        if layer.offset != end if contiguous else layer.offset < end:
            raise UpstreamError(f"{what}'s pieces overlap or do not follow each other")
        end = layer.offset + layer.length
        if limit is not None and end > limit:
            raise UpstreamError(f"{what} has a piece past its end")
    return end


def config_bytes(config: dict[str, Any]) -> bytes:
    return json.dumps(config, separators=(",", ":"), sort_keys=True).encode()


def _bad(where: str, why: str) -> UpstreamError:
    return UpstreamError(f"{where} is not a forkd snapshot this forkd can read: {why}")


def parse_manifest(body: bytes, where: str) -> Manifest:
    """A registry's manifest, every field checked; :class:`UpstreamError` naming ``where``."""
    try:
        data = json.loads(body)
        if data.get("schemaVersion") != 2 or data.get("mediaType", MANIFEST_TYPE) != MANIFEST_TYPE:
            raise _bad(where, "not an OCI image manifest")
        config = data["config"]
        if config.get("mediaType") != CONFIG_TYPE:
            raise _bad(where, "its config is not a forkd snapshot's")
        raw_layers = data["layers"]
        if not isinstance(raw_layers, list) or len(raw_layers) > MAX_LAYERS:
            raise _bad(where, "its layers are not a list of a sane length")
        layers = tuple(_layer(raw, where) for raw in raw_layers)
        cdigest, csize = _digest(config["digest"], where), _int(config["size"], where)
        if csize > CONFIG_BYTES_LIMIT:
            raise _bad(where, f"its config is {csize} bytes")
        annotations = data.get("annotations") or {}
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise _bad(where, f"malformed manifest ({_why(exc)})") from exc
    return Manifest(cdigest, csize, layers, {str(k): str(v) for k, v in annotations.items()})


def _layer(raw: dict[str, Any], where: str) -> Layer:
    kind = raw["mediaType"]
    if kind not in LAYER_TYPES:
        raise _bad(where, "a layer of a type forkd does not know")
    notes = raw.get("annotations") or {}
    layer = Layer(
        kind,
        _digest(raw["digest"], where),
        _int(raw["size"], where),
        str(notes.get(PART, "")),
        _int(notes.get(OFFSET, "0"), where),
        _int(notes.get(LENGTH, "0"), where),
    )
    if not 0 < layer.length <= MAX_PIECE or layer.size > layer.length + (1 << 20):
        raise _bad(where, f"layer {layer.digest} claims {layer.length} bytes in {layer.size}")
    if kind not in COMPRESSED_TYPES and layer.size != layer.length:
        raise _bad(where, f"uncompressed layer {layer.digest} has two lengths")
    return layer


def _digest(value: Any, where: str) -> str:
    if not isinstance(value, str) or not DIGEST.fullmatch(value):
        raise _bad(where, "a malformed digest")
    return value


def _int(value: Any, where: str) -> int:
    number = int(value)
    if number < 0 or number > 1 << 48:
        raise _bad(where, "a number out of range")
    return number


def parse_config(body: bytes, where: str) -> dict[str, Any]:
    """A snapshot's config: the fields :mod:`forkd.oci.pull` reads must be there and typed."""
    try:
        config = json.loads(body)
        if (version := config.get("format")) != CONFIG_FORMAT:
            shown = version if type(version) is int else "unknown"
            raise _bad(where, f"config format {shown}, this forkd reads {CONFIG_FORMAT}")
        memory = config["memory"]
        if memory["encoding"] not in ("chunks", "delta"):
            raise _bad(where, "a memory encoding forkd does not know")
        _int(memory["bytes"], where)
        if memory["encoding"] == "delta":
            _digest(memory["base"]["digest"], where)
        for key in ("machine", "needs", "image", "snapshot"):
            if not isinstance(config[key], dict):
                raise _bad(where, f"config {key!r} is not an object")
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise _bad(where, f"malformed config ({_why(exc)})") from exc
    return config


def _why(exc: Exception) -> str:
    """What was malformed, in forkd's words: a missing key (named by this module) or the
    kind of error. Never the exception's text, which may quote the registry's bytes."""
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str):
        return f"no {exc.args[0]!r}"
    return type(exc).__name__
