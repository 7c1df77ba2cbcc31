"""What images this host has: the ones built, loaded or imported here (never one
pulled with a snapshot), which image each local name finds, which names and layers
each holds, and what to say when a name finds none."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forkd import paths
from forkd.guest import container_image
from forkd.guest import image as images


def local_images(built: list[images.Image] | None = None) -> list[images.Image]:
    """The images built, loaded or imported here (never one pulled with a snapshot), of
    ``built`` (default: every image in the cache)."""
    return [
        img
        for img in (images.list_images() if built is None else built)
        if container_image.is_container(img) and not img.meta.get("pulled")
    ]


def local(name: str, *, registry_too: bool = False) -> images.Image | None:
    """The newest local image that the name ``name`` (``myapp:1``, ``myapp`` for
    ``myapp:latest``) names: one loaded or built with it here, or, for a name without a
    registry host, imported as it. A registry reference of a host is asked again (but
    ``registry_too``: then its import answers for it)."""
    from forkd.oci.reference import names_registry

    if "@" in name:
        return None
    wanted = container_image.with_tag(name)
    sources = container_image.LOCAL_SOURCES if names_registry(name) and not registry_too else None

    def matches(img: images.Image) -> bool:
        ref = container_image.local_names(img).get(wanted)
        return ref is not None and (sources is None or ref.startswith(sources))

    return newest_container(matches)


@dataclass(frozen=True)
class Catalog:
    """What an image's info is read against: how many images use each layer, which
    image each local name finds, where snapshots and VMs that may use one live."""

    layer_users: dict[str, int]
    holders: dict[str, Path]
    roots: list[Path]


def name_holders(built: list[images.Image]) -> dict[str, Path]:
    """Each local name, and the directory of the image it finds now (the newest local
    image given it, as :func:`local` with ``registry_too`` picks)."""
    newest: dict[str, images.Image] = {}
    for img in local_images(built):
        for name in container_image.local_names(img):
            held = newest.get(name)
            if held is None or img.meta.get("built_at_unix", 0) > held.meta.get("built_at_unix", 0):
                newest[name] = img
    return {name: img.dir for name, img in newest.items()}


def names_held(img: images.Image, holders: dict[str, Path]) -> list[str]:
    """The local names that find ``img`` now: of its names, those no newer image took."""
    return [n for n in container_image.local_names(img) if holders.get(n) == img.dir]


def untag(name: str, keep: images.Image | None = None) -> None:
    """Take the local name ``name`` off every image that has it (but ``keep``)."""
    for img in local_images():
        if keep is not None and img.dir == keep.dir:
            continue
        refs = {
            ref
            for ref in img.meta.get("references") or []
            if container_image.local_names_of(ref) == name
        }
        if refs:
            container_image.drop_references(img, refs)


def no_local_image(name: str, what: str = "no local image") -> str:
    """``no local image 'myap:2' (did you mean myapp:2?)``, and how to get one."""
    import difflib

    built = images.list_images()
    known = set(name_holders(built))
    known |= {img.name for img in built if not container_image.is_container(img)}
    wanted = container_image.with_tag(name) if ":" in name else name
    close = difflib.get_close_matches(wanted, sorted(known), n=3, cutoff=0.6)
    if not close and ":" not in name:  # myap -> myapp:latest
        bare = {k.removesuffix(":latest"): k for k in known}
        close = [bare[c] for c in difflib.get_close_matches(name, sorted(bare), n=3, cutoff=0.6)]
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return (
        f"{what} {name!r}{hint}: build it (forkd image build NAME for a recipe, -t NAME:TAG "
        "for a Dockerfile), load it (forkd image load) or give a registry reference with "
        "its host (registry.example.com[:port]/repository:tag)"
    )


def newest_import(name: str) -> images.Image | None:
    """The newest build of the imported image ``name`` (``oci-<id>``, as GET /v1/images
    lists it; an import writes no pointer file for find_image), if there is one."""
    return newest_container(lambda img: name in (img.name, f"{img.name}-{img.key}"))


def newest_container(matches: Callable[[images.Image], bool]) -> images.Image | None:
    """The newest imported (container) build that ``matches``, if there is one. An image
    pulled with a snapshot is never one: its record (references, digests, build time)
    is what another host, or a registry, said of it."""
    found = [img for img in local_images() if matches(img)]
    return max(found, key=lambda i: i.meta.get("built_at_unix", 0)) if found else None


def layer_users(built: list[images.Image]) -> dict[str, int]:
    """How many imported images use each layer blob."""
    counts: collections.Counter[str] = collections.Counter()
    for img in built:
        if container_image.is_container(img):
            counts.update(set(img.meta.get("layers") or []))
    return dict(counts)


def blob_sizes(digests: list[str]) -> dict[str, int]:
    root = paths.blobs_dir() / "sha256"
    sizes = {}
    for digest in digests:
        with contextlib.suppress(OSError):
            sizes[digest] = (root / digest.removeprefix("sha256:")).stat().st_size
    return sizes
