"""A guest image's files as registry pieces: their digests, a check of a local build, an install.

Images are keyed by their inputs (:mod:`forkd.guest.image`), so two hosts can
hold builds of one key whose bytes differ; a restored guest's page cache
would then not match its disk. A pulled snapshot therefore brings its image
files, in :data:`~forkd.oci.artifact.IMAGE_PIECE` pieces, uncompressed (a
squashfs is compressed already). A host whose build of that name and key has
every piece the same uses it; otherwise the pulled files go into a directory
of their own, named by their content (``<name>-<key>-pulled-<id>``), never
the build's: a later ``forkd image build`` must not take a registry's files
for its own. A file the pulled image shares with another image on this host
(the kernel and initramfs of one build, the runtime disk every imported
container image of one forkd has) is hard-linked from it, not fetched: pieces
equal, bytes equal. Digests of local files are cached by
path, size and modification time: an image file is never rewritten in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forkd import limits, processes
from forkd.errors import Conflict, UpstreamError
from forkd.oci import artifact
from forkd.oci.artifact import IMAGE_PIECE, Manifest

Piece = tuple[int, int, str]  # offset, length, digest
_cache: dict[tuple[str, int, int], list[Piece]] = {}
_cache_lock = threading.Lock()


def pieces(path: Path) -> list[Piece]:
    """``path`` cut in image pieces, each with its digest (cached while the file is unchanged)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    found: list[Piece] = []
    with path.open("rb") as f:
        offset = 0
        while piece := f.read(IMAGE_PIECE):
            found.append((offset, len(piece), "sha256:" + hashlib.sha256(piece).hexdigest()))
            offset += len(piece)
    with _cache_lock:
        _cache[key] = found
    return found


def local_meta(image_dir: Path) -> dict[str, Any]:
    """A local image's ``image.json`` (``{}`` when unreadable)."""
    try:
        data = json.loads((image_dir / "image.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_piece(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(length)


def wanted(manifest: Manifest, names: tuple[str, ...]) -> dict[str, list[Piece]]:
    """The pieces of each image file ``names`` (the config's, see
    :func:`forkd.oci.artifact.image_file_names`) a manifest carries, checked to tile
    each file; an image file the config does not name is refused, not ignored."""
    files: dict[str, list[Piece]] = {}
    for name in names:
        layers = manifest.of_part(name)
        if not layers:
            raise UpstreamError(f"the snapshot carries no {name} of its guest image")
        what = f"the snapshot's {name}"
        artifact.check_placed(layers, artifact.IMAGE_FILE_TYPE, what, contiguous=True)
        files[name] = [(la.offset, la.length, la.digest) for la in layers]
    stray = {la.part for la in manifest.layers if la.media_type == artifact.IMAGE_FILE_TYPE}
    if stray - set(names):
        raise UpstreamError("the snapshot carries an image file its config does not name")
    return files


def image_dir_name(config: dict[str, Any]) -> tuple[str, str]:
    """The image's name and key from a config, checked to be safe as a directory name."""
    image = config["image"]
    name, key = str(image.get("name") or ""), str(image.get("key") or "")
    if not limits.NAME_RE.fullmatch(name) or not key.isalnum() or not 0 < len(key) <= 64:
        raise UpstreamError(f"the snapshot names an invalid image {name!r} ({key!r})")
    return name, key


def differences(image_dir: Path, files: dict[str, list[Piece]]) -> list[str]:
    """How the local build at ``image_dir`` differs from the pieces a snapshot carries."""
    found = []
    for name, want in files.items():
        path = image_dir / name
        try:
            have = pieces(path)
        except OSError:
            found.append(f"{name} is missing")
            continue
        if have != want:
            at = next((w[0] for h, w in zip(have, want, strict=False) if h != w), None)
            where = f"from byte {at}" if at is not None else "in length"
            found.append(f"{name} differs {where}")
    return found


def content_id(files: dict[str, list[Piece]]) -> str:
    """What names an image's bytes: a digest over every piece's digest."""
    h = hashlib.sha256()
    for name in sorted(files):
        for offset, length, digest in files[name]:
            h.update(f"{name} {offset} {length} {digest}\n".encode())
    return h.hexdigest()[:16]


def local_dir(
    images_root: Path, config: dict[str, Any], files: dict[str, list[Piece]]
) -> Path | None:
    """An image directory on this host holding exactly the snapshot's image files: the
    local build of that name and key if its bytes are the same, else an earlier pull of
    them; ``None`` when the image must be pulled too."""
    name, key = image_dir_name(config)
    for d in (images_root / f"{name}-{key}", pulled_dir(images_root, config, files)):
        if (d / "image.json").is_file() and not differences(d, files):
            return d
    return None


def pulled_dir(images_root: Path, config: dict[str, Any], files: dict[str, list[Piece]]) -> Path:
    """Where a pulled image goes: never a local build's directory (``forkd image build``
    would take a directory of its name and key for its own), but one named by content."""
    name, key = image_dir_name(config)
    return images_root / f"{name}-{key}-pulled-{content_id(files)}"


def install(
    images_root: Path,
    config: dict[str, Any],
    files: dict[str, list[Piece]],
    fetch: Callable[[str, int], bytes],
    meta: dict[str, Any],
) -> Path:
    """Write the image the snapshot carries under ``images_root``: staged, then renamed.

    ``fetch(digest, size)`` returns a checked blob. A file another image here has
    with the same pieces is hard-linked from it instead. ``meta``: what its
    ``image.json`` says beside its name and key (checked by the caller: it came
    from the registry too). Returns the image directory.
    """
    name, key = image_dir_name(config)
    final = pulled_dir(images_root, config, files)
    images_root.mkdir(parents=True, exist_ok=True)
    prefix = f".staging-pull-{name}-{processes.mark()}"
    staging = Path(tempfile.mkdtemp(dir=images_root, prefix=prefix))
    try:
        for fname, want in files.items():
            if _link_same(images_root, fname, want, staging / fname):
                continue
            with (staging / fname).open("wb") as out:
                for _offset, length, digest in want:
                    out.write(fetch(digest, length))
                out.flush()
                os.fsync(out.fileno())
            (staging / fname).chmod(0o644)
        record = {**meta, "name": name, "key": key, "pulled": True}
        (staging / "image.json").write_text(json.dumps(record, indent=2) + "\n")
        try:
            staging.rename(final)
        except OSError:
            if not (final / "image.json").is_file():
                raise
            problems = differences(final, files)  # another pull put it there first
            if problems:
                raise Conflict(
                    f"image {final.name} appeared meanwhile and differs: {problems[0]}"
                ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _link_same(images_root: Path, fname: str, want: list[Piece], target: Path) -> bool:
    """Hard-link ``target`` to a file ``fname`` of another image under ``images_root``
    whose pieces are ``want``; whether one was found. Only files of the same length are
    hashed (once per file while it is unchanged: :func:`pieces` caches)."""
    length = sum(n for _o, n, _d in want)
    for d in sorted(images_root.iterdir()):
        if d.name.startswith(".") or not (d / "image.json").is_file():
            continue  # a staging or half-removed directory: not an image
        path = d / fname
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size != length:
                continue
            if pieces(path) != want:
                continue
            os.link(path, target)
        except OSError:
            continue
        return True
    return False
