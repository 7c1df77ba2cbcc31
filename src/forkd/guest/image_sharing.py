"""One image cache, several daemons: which snapshots use an image, and which images
imports are building, whichever daemon on the host made them.

The cache (``<cache>/images``, ``<cache>/blobs``) is shared by every daemon whose
``FORKD_CACHE_DIR`` is the same: a recipe image takes minutes to build, and a
layer fetched once serves them all. Removing from it is therefore never one
daemon's decision alone:

* Each daemon records where its snapshots and VMs live when it starts
  (``<cache>/images/.daemons/<id>.json``); an image is in use while a snapshot or
  VM under any recorded daemon's directories names it (a record whose state
  directory is gone is dropped).
* An import building or finding an image claims its name in a file of its own
  (``<cache>/images/.claims/@PID.TICKS.<random>``); a removal is refused while a
  live claim names the image. Claims are made, and removals decide and move the
  build away, under one ``flock`` (``.claims/.lock``): an import either claims
  first (the removal is refused) or finds the build already gone (and builds it).

Blobs are kept by their own hold files (:mod:`forkd.image_import.blob_store`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from forkd import file_lock, paths, processes
from forkd.errors import Conflict

DAEMONS = ".daemons"
CLAIMS = ".claims"


def record_daemon(state_dir: Path, roots: list[Path], images_dir: Path | None = None) -> Path:
    """Record that the daemon of ``state_dir`` keeps snapshots and VMs under ``roots``;
    the record's path."""
    root = (images_dir or paths.images_dir()) / DAEMONS
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    state = str(Path(state_dir).absolute())
    record = root / f"{hashlib.sha256(state.encode()).hexdigest()[:16]}.json"
    body = {"state_dir": state, "roots": [str(Path(r).absolute()) for r in roots]}
    staged = root / f".{record.name}.{secrets.token_hex(4)}"
    staged.write_text(json.dumps(body))
    os.replace(staged, record)
    return record


def recorded_roots(images_dir: Path | None = None) -> list[Path]:
    """The snapshot and VM directories of every daemon recorded on this cache (records
    whose state directory is gone are removed)."""
    root = (images_dir or paths.images_dir()) / DAEMONS
    found: list[Path] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return found
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            body = json.loads((root / name).read_text())
            state, roots = Path(body["state_dir"]), [Path(r) for r in body["roots"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not state.is_dir():
            (root / name).unlink(missing_ok=True)
            continue
        found += [r for r in roots if r not in found]
    return found


@contextlib.contextmanager
def building(name: str, images_dir: Path | None = None) -> Iterator[None]:
    """Claim the image ``name`` while an import builds or finds it: no daemon removes
    it meanwhile."""
    claims = (images_dir or paths.images_dir()) / CLAIMS
    with file_lock.locked(claims / ".lock"):
        claim = claims / f"{processes.mark()}{secrets.token_hex(8)}"
        claim.write_text(name)
    try:
        yield
    finally:
        claim.unlink(missing_ok=True)


@contextlib.contextmanager
def removing(name: str, images_dir: Path | None = None) -> Iterator[None]:
    """Hold the claims lock while the image ``name`` is checked and moved away; 409 while
    an import (in any daemon on the host) builds it."""
    claims = (images_dir or paths.images_dir()) / CLAIMS
    with file_lock.locked(claims / ".lock"):
        if name in _claimed(claims):
            raise Conflict(f"image {name} is being imported now: retry shortly")
        yield


def _claimed(claims: Path) -> set[str]:
    """The names live claims hold (a dead process's claim is removed)."""
    names: set[str] = set()
    for _holder, path in processes.live_marked_files(claims):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            names.add(path.read_text())
    return names
