"""Where forkd keeps its files: the build cache, the state directory and the daemon's token."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Build cache (images, kernels, base root filesystems): ``FORKD_CACHE_DIR``."""
    env = os.environ.get("FORKD_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "forkd"


def images_dir() -> Path:
    return cache_dir() / "images"


def blobs_dir() -> Path:
    """Imported container images' layers and manifests, by digest (``<cache>/blobs``)."""
    return cache_dir() / "blobs"


def state_dir() -> Path:
    """Daemon state (database, snapshots, audit log): ``FORKD_STATE_DIR``."""
    env = os.environ.get("FORKD_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/forkd")
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "forkd"


def token_file(state: Path | None = None) -> Path:
    """The bearer token a daemon writes on its first start: ``<state-dir>/token``.

    ``state`` is the daemon's state directory (default: :func:`state_dir`).
    """
    return (state_dir() if state is None else state) / "token"


def run_dir() -> Path:
    """Per-VM runtime files (QMP and agent sockets, logs): ``FORKD_RUN_DIR``."""
    env = os.environ.get("FORKD_RUN_DIR")
    if env:
        return Path(env)
    return state_dir() / "run"
