"""An image's manifests and config read as hostile JSON: OCI and Docker manifests, indexes
and manifest lists, the linux/amd64 pick, and the config forkd honours.

Every document is bounded before it is parsed (:data:`MAX_DOCUMENT_BYTES`, a
nesting depth of :data:`MAX_DEPTH` checked by a linear scan, so a
``[[[[...`` a hundred thousand deep is refused, never recursed into), and every
descriptor's digest (sha256 only) and size are checked before anything is
fetched by it. Schema 1 manifests, foreign and non-distributable layers, and
layers of any type but a tar (plain, gzip or zstd) are refused, each saying why.
The errors are :class:`~forkd.errors.Invalid`: the image is the caller's input.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from forkd.errors import Invalid
from forkd.image_import.model import ImageConfig
from forkd.oci.reference import DIGEST

MAX_DOCUMENT_BYTES = 4 << 20  # a manifest, an index or a config
MAX_DEPTH = 32  # nesting of arrays and objects in one document
MAX_LAYERS = 256
MAX_INDEX_ENTRIES = 1024
MAX_BLOB_BYTES = 64 << 30  # one layer as stored (compressed)
MAX_CONFIG_STRINGS = 4096  # entries of Env, Cmd, Entrypoint, ExposedPorts, Labels
MAX_CONFIG_STRING = 64 << 10

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
SCHEMA1 = frozenset(
    {
        "application/vnd.docker.distribution.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v1+prettyjws",
    }
)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
ACCEPTED = (*MANIFEST_TYPES, *INDEX_TYPES)
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
CONFIG_TYPES = (OCI_CONFIG, DOCKER_CONFIG)
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
LAYER_TYPES = frozenset(
    {
        OCI_LAYER,
        f"{OCI_LAYER}+gzip",
        f"{OCI_LAYER}+zstd",
        "application/vnd.docker.image.rootfs.diff.tar",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
    }
)
PLATFORM = ("linux", "amd64")

_STRINGS = re.compile(rb'"(?:[^"\\]|\\(?s:.)?)*+(?:"|\Z)')  # linear: never backtracks
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = [0] * 256
_DEPTH_STEP[ord("[")] = _DEPTH_STEP[ord("{")] = 1
_DEPTH_STEP[ord("]")] = _DEPTH_STEP[ord("}")] = -1


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    ref_name: str = ""  # an OCI layout's org.opencontainers.image.ref.name


@dataclass(frozen=True)
class ImageManifest:
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageIndex:
    media_type: str
    manifests: tuple[Descriptor, ...]


def load_json(data: bytes, what: str) -> Any:
    """``data`` parsed as JSON, within :data:`MAX_DOCUMENT_BYTES` and :data:`MAX_DEPTH`."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise Invalid(f"{what} is larger than {MAX_DOCUMENT_BYTES} bytes: refused")
    brackets = _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    if max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > MAX_DEPTH:
        raise Invalid(f"{what} is nested more than {MAX_DEPTH} levels deep: refused")
    try:
        return json.loads(data)
    except RecursionError:  # unreachable after the scan; never let one escape
        raise Invalid(f"{what} is nested too deeply: refused") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise Invalid(f"{what} is not valid JSON ({_short(str(exc))})") from None


def parse_manifest(data: bytes, media_type: str, what: str) -> ImageManifest | ImageIndex:
    """An image manifest or an index; ``media_type`` is what the source said it is
    (a Content-Type, a descriptor's), "" when it said nothing."""
    doc = load_json(data, what)
    if not isinstance(doc, dict):
        raise Invalid(f"{what} is not a JSON object")
    stated = doc.get("mediaType")
    if stated is not None and not isinstance(stated, str):
        raise Invalid(f"{what} has a malformed mediaType")
    if doc.get("schemaVersion") == 1 or stated in SCHEMA1 or media_type in SCHEMA1:
        raise Invalid(
            f"{what} is a Docker schema 1 manifest, a format retired in 2017 that forkd "
            "does not import: push the image again with a current docker or skopeo"
        )
    if doc.get("schemaVersion") != 2:
        raise Invalid(f"{what} has schemaVersion {_short(repr(doc.get('schemaVersion')))}, not 2")
    if stated and media_type in ACCEPTED and stated != media_type:
        raise Invalid(f"{what} says it is {_short(stated)} but was served as {media_type}")
    kind = stated or media_type
    if not kind or kind not in ACCEPTED:
        if kind:
            raise Invalid(
                f"{what} is of type {_short(kind)}, not a container image: forkd imports "
                "OCI and Docker image manifests and indexes"
            )
        kind = OCI_INDEX if "manifests" in doc else OCI_MANIFEST
    if kind in INDEX_TYPES:
        return _index(doc, kind, what)
    return _manifest(doc, kind, what)


def _index(doc: dict[str, Any], kind: str, what: str) -> ImageIndex:
    entries = doc.get("manifests")
    if not isinstance(entries, list):
        raise Invalid(f"{what} is an index without a list of manifests")
    if len(entries) > MAX_INDEX_ENTRIES:
        raise Invalid(f"{what} lists {len(entries)} manifests; at most {MAX_INDEX_ENTRIES}")
    return ImageIndex(
        kind,
        tuple(
            descriptor(e, f"{what}'s manifest {i}", MAX_DOCUMENT_BYTES)
            for i, e in enumerate(entries)
        ),
    )


def _manifest(doc: dict[str, Any], kind: str, what: str) -> ImageManifest:
    config = descriptor(doc.get("config"), f"{what}'s config", MAX_DOCUMENT_BYTES)
    if config.media_type not in CONFIG_TYPES:
        raise Invalid(
            f"{what} has a config of type {_short(config.media_type)}: not a container "
            "image (an artifact of another kind?)"
        )
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise Invalid(f"{what} has no list of layers")
    if len(layers) > MAX_LAYERS:
        raise Invalid(f"{what} has {len(layers)} layers; at most {MAX_LAYERS} are imported")
    found = tuple(
        descriptor(d, f"{what}'s layer {i + 1}", MAX_BLOB_BYTES) for i, d in enumerate(layers)
    )
    for i, layer in enumerate(found):
        check_layer_type(layer.media_type, f"{what}'s layer {i + 1}")
    return ImageManifest(kind, config, found)


def check_layer_type(media_type: str, what: str) -> None:
    if media_type in LAYER_TYPES:
        return
    if "nondistributable" in media_type or "foreign" in media_type:
        raise Invalid(
            f"{what} is a foreign (non-distributable) layer ({_short(media_type)}), fetched "
            "from elsewhere than the registry: forkd does not import such images"
        )
    raise Invalid(
        f"{what} is of type {_short(media_type)}: forkd imports layers that are tar "
        "archives, plain, gzip or zstd"
    )


def descriptor(value: Any, what: str, max_size: int) -> Descriptor:
    """A descriptor checked: a sha256 digest, a size from 0 to ``max_size``."""
    if not isinstance(value, dict):
        raise Invalid(f"{what} is not a descriptor")
    media_type, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
    if not isinstance(media_type, str) or not media_type or len(media_type) > 255:
        raise Invalid(f"{what} has no media type")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise Invalid(f"{what} has the digest {_short(repr(digest))}: forkd takes sha256:<hex>")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise Invalid(f"{what} has a malformed size")
    if size > max_size:
        raise Invalid(f"{what} is {size} bytes, more than the {max_size} accepted")
    platform = None
    if isinstance(value.get("platform"), dict):
        p = value["platform"]
        platform = Platform(_str(p.get("os")), _str(p.get("architecture")), _str(p.get("variant")))
    annotations = value.get("annotations")
    ref_name = ""
    if isinstance(annotations, dict):
        ref_name = _str(annotations.get("org.opencontainers.image.ref.name"))
    return Descriptor(media_type, digest, size, platform, ref_name)


def pick_platform(index: ImageIndex, what: str) -> Descriptor:
    """The index's linux/amd64 image manifest (or nested index); the one entry, when the
    index says nothing of platforms."""
    candidates = [d for d in index.manifests if d.media_type in ACCEPTED]
    if len(candidates) == 1 and candidates[0].platform is None:
        return candidates[0]
    wanted = [
        d for d in candidates if d.platform and (d.platform.os, d.platform.architecture) == PLATFORM
    ]
    if not wanted:
        listed = sorted({str(d.platform) for d in candidates if d.platform})
        raise Invalid(
            f"{what} has no linux/amd64 image (forkd runs linux/amd64): it has "
            + (", ".join(listed[:20]) if listed else "no platform forkd can run")
        )
    # Variants (v2, v3: newer x86-64 levels) matter only when there are several: the
    # lowest runs on the most machines.
    return min(wanted, key=lambda d: (d.platform.variant if d.platform else "") not in ("", "v1"))


@dataclass(frozen=True)
class ParsedConfig:
    config: ImageConfig
    diff_ids: tuple[str, ...]
    platform: Platform


def parse_config(data: bytes, layers: int, what: str) -> ParsedConfig:
    """The config blob: what forkd honours of it, the layers' diff ids (as many as
    ``layers``), its platform (linux/amd64, or unstated)."""
    doc = load_json(data, what)
    if not isinstance(doc, dict):
        raise Invalid(f"{what} is not a JSON object")
    platform = Platform(
        _str(doc.get("os")), _str(doc.get("architecture")), _str(doc.get("variant"))
    )
    if (platform.os or "linux", platform.architecture or "amd64") != PLATFORM:
        raise Invalid(f"{what} is of an image for {platform}: forkd runs linux/amd64")
    rootfs = doc.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or not all(
        isinstance(d, str) and DIGEST.fullmatch(d) for d in diff_ids
    ):
        raise Invalid(f"{what} has no list of sha256 layer diff_ids (rootfs.diff_ids)")
    if len(diff_ids) != layers:
        raise Invalid(
            f"{what} names {len(diff_ids)} layers (rootfs.diff_ids), the manifest {layers}"
        )
    c = doc.get("config") or {}
    if not isinstance(c, dict):
        raise Invalid(f"{what} has a malformed config")
    ports = c.get("ExposedPorts") or {}
    labels = c.get("Labels") or {}
    if not isinstance(ports, dict) or not isinstance(labels, dict):
        raise Invalid(f"{what} has malformed ExposedPorts or Labels")
    config = ImageConfig(
        env=_strings(c.get("Env"), f"{what}'s Env"),
        working_dir=_text(c.get("WorkingDir"), f"{what}'s WorkingDir"),
        user=_text(c.get("User"), f"{what}'s User"),
        entrypoint=_strings(c.get("Entrypoint"), f"{what}'s Entrypoint"),
        cmd=_strings(c.get("Cmd"), f"{what}'s Cmd"),
        exposed_ports=tuple(sorted(_strings(list(ports), f"{what}'s ExposedPorts"))),
        labels=dict(
            zip(
                _strings(list(labels), f"{what}'s Labels"),
                _strings(list(labels.values()), f"{what}'s Labels"),
                strict=True,
            )
        ),
        stop_signal=_text(c.get("StopSignal"), f"{what}'s StopSignal"),
    )
    return ParsedConfig(config, tuple(diff_ids), platform)


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_CONFIG_STRINGS:
        raise Invalid(f"{what} is not a list of at most {MAX_CONFIG_STRINGS} strings")
    return tuple(_text(v, what) for v in value)


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_CONFIG_STRING or "\0" in value:
        raise Invalid(f"{what} is not a string of at most {MAX_CONFIG_STRING} characters")
    return value


def _str(value: Any) -> str:
    return value[:255] if isinstance(value, str) else ""


def _short(text: str) -> str:
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= 120 else text[:120] + "..."
