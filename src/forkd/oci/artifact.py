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

The config's ``format`` says which of these a reader must understand. Format 1:
the image is ``vmlinuz``, ``initrd.img`` and ``rootfs.sqfs``. Format 2 adds the
config's ``image.files``, the image files carried, which may include
``runtime.sqfs`` (an imported container image's runtime disk, its guest's second
disk). A push writes format 1 whenever the snapshot fits it, so a forkd that
reads only format 1 still pulls every recipe snapshot, and refuses by the format
alone a snapshot it could not restore.

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
from forkd.vmm.qemu.argv import RUNTIME_CMDLINE

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
CONFIG_FORMAT = 2  # the newest format this forkd writes (only when it must) and reads
CONFIG_FORMATS = (1, 2)
MEMORY_CHUNK = 1 << 20
PAGES_PIECE = 4 << 20
IMAGE_PIECE = 16 << 20
IMAGE_FILES = ("vmlinuz", "initrd.img", "rootfs.sqfs")  # every snapshot's image has these
RUNTIME_FILE = "runtime.sqfs"  # an imported container image's runtime disk (format 2)
OPTIONAL_IMAGE_FILES = (RUNTIME_FILE,)
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


def config_format(image_files: tuple[str, ...]) -> int:
    """The oldest format that describes a snapshot whose image is ``image_files``."""
    return 1 if image_files == IMAGE_FILES else CONFIG_FORMAT


def image_file_names(config: dict[str, Any]) -> tuple[str, ...]:
    """The image files a config (checked by :func:`parse_config`, or being written) says
    the snapshot carries."""
    if config.get("format") == 1:
        return IMAGE_FILES
    return tuple(config["image"]["files"])


def parse_config(body: bytes, where: str) -> dict[str, Any]:
    """A snapshot's config: the fields :mod:`forkd.oci.pull` reads must be there and typed."""
    try:
        # Anything but an object fails at .get (AttributeError, caught below).
        config: dict[str, Any] = json.loads(body)
        if (version := config.get("format")) not in CONFIG_FORMATS or type(version) is not int:
            shown = version if type(version) is int else "unknown"
            reads = " and ".join(str(f) for f in CONFIG_FORMATS)
            raise _bad(where, f"config format {shown}, this forkd reads {reads}")
        memory = config["memory"]
        if memory["encoding"] not in ("chunks", "delta"):
            raise _bad(where, "a memory encoding forkd does not know")
        _int(memory["bytes"], where)
        if memory["encoding"] == "delta":
            _digest(memory["base"]["digest"], where)
        for key in ("machine", "needs", "image", "snapshot"):
            if not isinstance(config[key], dict):
                raise _bad(where, f"config {key!r} is not an object")
        _check_image_files(config, where)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise _bad(where, f"malformed config ({_why(exc)})") from exc
    return config


def _check_image_files(config: dict[str, Any], where: str) -> None:
    """Format 2's list of image files: every required one, known optional ones, once each;
    and a runtime disk carried exactly when the guest's kernel was told to wait for one
    (a snapshot whose guest needs a disk it lacks would hang at its first read of it)."""
    if config["format"] == 1:
        names: tuple[str, ...] = IMAGE_FILES
    else:
        listed = config["image"]["files"]
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise _bad(where, "its image files are not a list of names")
        names = tuple(listed)
        if set(names) - set(IMAGE_FILES) - set(OPTIONAL_IMAGE_FILES):
            raise _bad(where, "an image file forkd does not know")  # never echoed: theirs
        if len(set(names)) != len(names) or not set(IMAGE_FILES) <= set(names):
            raise _bad(where, f"its image files are not {', '.join(IMAGE_FILES)} and extras")
    cmdline = config["machine"].get("cmdline", "")
    needs_runtime = isinstance(cmdline, str) and RUNTIME_CMDLINE in cmdline.split()
    if needs_runtime and RUNTIME_FILE not in names:
        raise _bad(
            where,
            "its guest needs a runtime disk the artifact does not carry (pushed by a forkd "
            "that did not send it: push the snapshot again with this one)",
        )
    if RUNTIME_FILE in names and not needs_runtime:
        raise _bad(where, "it carries a runtime disk its guest was not booted with")


def _why(exc: Exception) -> str:
    """What was malformed, in forkd's words: a missing key (named by this module) or the
    kind of error. Never the exception's text, which may quote the registry's bytes."""
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str):
        return f"no {exc.args[0]!r}"
    return type(exc).__name__
