"""Images in ``docker save`` archives (from a file, or as the local Docker Engine exports
them): ``manifest.json``'s image, its config, and its layers checked against the config.

``manifest.json`` gives a layer by its place in the archive, with no digest: each
is hashed as it is copied into the store (through its decompression, when it
is gzip or zstd, as newer Docker saves may hold) and must match the config's
``rootfs.diff_ids``; a config named by its digest must match that too. The
archive is read through :class:`~forkd.image_import.local_sources.TarFiles`,
never unpacked. A layer the store holds already as its plain tar is not read
again.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any

from forkd.errors import Invalid, NotFound
from forkd.image_import import manifests
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.diff_ids import copy_checking_diff_id
from forkd.image_import.fetch import LAYER_CAP, Meter, Say, check_held, short_digest
from forkd.image_import.local_sources import TarFiles, read_small
from forkd.image_import.model import FetchedImage, ImageConfig, LayerBlob
from forkd.oci.reference import DIGEST


def import_docker_archive(
    files: TarFiles,
    tag: str | None,
    store: BlobStore,
    reference: str,
    say: Say,
    *,
    layer_cap: int = LAYER_CAP,
) -> FetchedImage:
    """The image of a ``docker save`` archive (the one it holds, or the one tagged ``tag``)."""
    say("manifest")
    entry = _docker_entry(files, tag, reference)
    config_name, layer_names = entry["Config"], entry["Layers"]
    config_data = read_small(files, config_name)
    config_digest = "sha256:" + hashlib.sha256(config_data).hexdigest()
    named = _named_digest(config_name)
    if named is not None and named != config_digest:
        raise Invalid(f"{reference}: the config {config_name} does not match its name")
    parsed = manifests.parse_config(config_data, len(layer_names), f"the config of {reference}")
    fetched = reused = 0
    layers: list[LayerBlob] = []
    for i, (name, diff_id) in enumerate(zip(layer_names, parsed.diff_ids, strict=True), 1):
        label = f"layer {i}/{len(layer_names)} {short_digest(diff_id)}"
        what = f"{reference}'s layer {i} ({name})"
        held = store.path(diff_id)  # the plain tar, whatever the archive holds it as
        if held is not None:
            if not store.is_verified(diff_id, diff_id):  # kept as another image's blob
                check_held(store, held, diff_id, diff_id, what, layer_cap)
            size = held.stat().st_size
            say(f"{label} cached ({size / (1 << 20):.1f} MiB)")
            layers.append(LayerBlob(diff_id, size, manifests.OCI_LAYER, held, diff_id))
            reused += size
            continue
        with files.open(name) as (size, chunks), store.writer(_named_digest(name), size) as w:
            media_type = copy_checking_diff_id(
                chunks, Meter(w, label, say).write, diff_id, what, cap=layer_cap
            )
            digest, held = w.commit()
        store.mark_verified(digest, diff_id)
        layers.append(LayerBlob(digest, size, media_type, held, diff_id))
        fetched += size
    if not store.has(config_digest):
        store.put(config_data, config_digest)
        fetched += len(config_data)
    return _fetched(
        store, reference, config_digest, len(config_data), parsed.config, layers, fetched, reused
    )


def from_held(store: BlobStore, config_digest: str, reference: str) -> FetchedImage | None:
    """The image whose config is ``config_digest``, when the store holds that config and
    every layer it names as its plain tar, each checked before (a Docker Engine's image
    imported already): nothing to read. None when anything is missing."""
    config_data = store.read(config_digest, manifests.MAX_DOCUMENT_BYTES)
    if config_data is None:
        return None
    try:
        count = len(json.loads(config_data)["rootfs"]["diff_ids"])
        parsed = manifests.parse_config(config_data, count, f"the config of {reference}")
    except (ValueError, KeyError, TypeError, Invalid):
        return None
    layers: list[LayerBlob] = []
    for diff_id in parsed.diff_ids:
        held = store.path(diff_id)
        if held is None or not store.is_verified(diff_id, diff_id):
            return None
        layers.append(LayerBlob(diff_id, held.stat().st_size, manifests.OCI_LAYER, held, diff_id))
    reused = sum(b.size for b in layers) + len(config_data)
    return _fetched(
        store, reference, config_digest, len(config_data), parsed.config, layers, 0, reused
    )


def _fetched(
    store: BlobStore,
    reference: str,
    config_digest: str,
    config_size: int,
    config: ImageConfig,
    layers: list[LayerBlob],
    fetched: int,
    reused: int,
) -> FetchedImage:
    """The image of a config and its layers, with the OCI manifest made for them (the
    archive has none) put in the store."""
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": manifests.OCI_MANIFEST,
            "config": {
                "mediaType": manifests.OCI_CONFIG,
                "digest": config_digest,
                "size": config_size,
            },
            "layers": [
                {"mediaType": b.media_type, "digest": b.digest, "size": b.size} for b in layers
            ],
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return FetchedImage(
        reference=reference,
        manifest_digest=store.put(manifest),
        config_digest=config_digest,
        config=config,
        layers=tuple(layers),
        bytes_fetched=fetched,
        bytes_reused=reused,
    )


def _docker_entry(files: TarFiles, tag: str | None, reference: str) -> dict[str, Any]:
    what = f"the manifest.json of {reference}"
    doc = manifests.load_json(read_small(files, "manifest.json"), what)
    if not isinstance(doc, list) or not doc or len(doc) > manifests.MAX_INDEX_ENTRIES:
        raise Invalid(f"{what} is not a list of 1 to {manifests.MAX_INDEX_ENTRIES} images")
    for entry in doc:
        ok = isinstance(entry, dict) and isinstance(entry.get("Config"), str)
        layers = entry.get("Layers") if ok else None
        if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
            raise Invalid(f"{what} has an image without a Config and a list of Layers")
        if len(layers) > manifests.MAX_LAYERS:
            raise Invalid(f"{what} has an image of {len(layers)} layers; at most 256")
    tags = [
        t
        for e in doc
        if isinstance(e.get("RepoTags"), list)
        for t in e["RepoTags"]
        if isinstance(t, str)
    ]
    if tag is None:
        if len(doc) == 1:
            only: dict[str, Any] = doc[0]
            return only
        raise Invalid(
            f"{reference} holds {len(doc)} images: name one with :IMAGE:TAG "
            f"(tags: {', '.join(tags[:20]) or 'none'})"
        )
    wanted = {tag} if ":" in tag.rsplit("/", 1)[-1] else {tag, f"{tag}:latest"}
    for entry in doc:
        if wanted & set(t for t in entry.get("RepoTags") or () if isinstance(t, str)):
            found: dict[str, Any] = entry
            return found
    raise NotFound(f"{reference}: no image tagged {tag!r} (tags: {', '.join(tags[:20]) or 'none'})")


def _named_digest(name: str) -> str | None:
    """The digest a member's name states: ``blobs/sha256/<hex>``, ``<hex>.json``."""
    base = posixpath.basename(name).removesuffix(".json")
    parent = posixpath.basename(posixpath.dirname(name))
    if parent == "sha256" or name.endswith(".json"):
        digest = f"sha256:{base}"
        return digest if DIGEST.fullmatch(digest) else None
    return None
