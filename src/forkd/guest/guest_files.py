"""The files forkd puts into every guest: :data:`GUEST_FILES`, the one list of them, each
with its source in the forkd package, its path in the guest and its mode.

The initramfs, forkd's own root image and a container image's runtime disk are
filled from it, and the image and runtime keys hash it, so a file added here is
installed and rebuilds the cached images at once. Two more are not files of the
package: the host's static busybox (``/opt/forkd/busybox``) and the empty
``/opt/forkd/forkd/__init__.py`` that makes forkd's modules there importable
(:func:`forkd.guest.rootfs.install_agent` adds both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

OPT = "/opt/forkd"  # the agent's directory: in forkd's root image, or the runtime disk
INITRAMFS = "initramfs"  # stage one's archive
ROOT = "root"  # the root filesystem


@dataclass(frozen=True)
class GuestFile:
    """One file of the forkd package, and where it goes in the guest."""

    source: str  # under the forkd package: "guest/files/init", "archive/unpack.py"
    dest: str  # absolute, in the initramfs or the root filesystem (``disk``)
    mode: int
    disk: str = ROOT  # INITRAMFS or ROOT

    def read(self) -> bytes:
        return resources.files("forkd").joinpath(self.source).read_bytes()


def _agent(name: str) -> GuestFile:
    """A file of ``forkd/guest/files``, beside the agent in /opt/forkd."""
    return GuestFile(f"guest/files/{name}", f"{OPT}/{name}", 0o644)


def _package(name: str) -> GuestFile:
    """A module of the forkd package the agent imports, as /opt/forkd/forkd/<name>."""
    return GuestFile(name, f"{OPT}/forkd/{name}", 0o644)


GUEST_FILES = (
    GuestFile("guest/files/initramfs-init", "/init", 0o755, INITRAMFS),  # stage one
    GuestFile("guest/files/init", f"{OPT}/init", 0o755),  # stage two, in the root
    GuestFile("guest/files/inittab", "/etc/inittab", 0o644),  # busybox init: the agent
    _agent("forkd-agent.py"),  # the agent's command line, which init runs
    # Its own parts.
    _agent("forkd_agent_transport.py"),
    _agent("forkd_agent_protocol.py"),
    _agent("forkd_agent_handlers.py"),
    _agent("forkd_agent_proc_handlers.py"),
    _agent("forkd_agent_params.py"),
    _agent("forkd_agent_command.py"),
    _agent("forkd_agent_legacy.py"),
    _agent("forkd_agent_log.py"),
    # Background processes, chunked file transfers and their tar streams, what a
    # sandbox changed and what it uses, Python eval, exec, and who a command runs as.
    _agent("forkd_procs.py"),
    _agent("forkd_files.py"),
    _agent("forkd_tar.py"),
    _agent("forkd_fsdiff.py"),
    _agent("forkd_fsfind.py"),
    _agent("forkd_stats.py"),
    _agent("forkd_eval.py"),
    _agent("forkd_exec.py"),
    _agent("forkd_identity.py"),
    _agent("forkd_entries.py"),
    _agent("forkd_watch.py"),
    # Eval in a container image: the agent's handle on its worker, and the worker
    # (a script the image's python3 runs, and its module).
    _agent("forkd_eval_proc.py"),
    _agent("forkd-eval-worker.py"),
    _agent("forkd_eval_worker.py"),
    # More eval contexts (E2B's code interpreter): workers of their own, Python or Node.js.
    _agent("forkd_eval_contexts.py"),
    _agent("forkd-js-worker.js"),
    # Seeds random in every Python process of a sandbox forked with a seed.
    _agent("seed/sitecustomize.py"),
    # The agent's wire format, which the daemon speaks too (standard library only).
    _package("agent_wire.py"),
    _package("agent_wire_entries.py"),
    # forkd's one tar extractor, which forkd_tar.py imports (standard library only).
    _package("archive/__init__.py"),
    _package("archive/beneath.py"),
    _package("archive/errors.py"),
    _package("archive/tar_fields.py"),
    _package("archive/tar_format.py"),
    _package("archive/unpack.py"),
)

# Stage one's, in the initramfs.
INITRAMFS_FILES = tuple(f for f in GUEST_FILES if f.disk == INITRAMFS)
# Under /opt/forkd: in forkd's root image, and the whole of a container image's runtime disk.
OPT_FILES = tuple(f for f in GUEST_FILES if f.disk == ROOT and f.dest.startswith(f"{OPT}/"))
# The rest of the root filesystem: only forkd's own root image has them.
ROOT_IMAGE_FILES = tuple(f for f in GUEST_FILES if f.disk == ROOT and f not in OPT_FILES)


class Hash(Protocol):
    def update(self, data: bytes, /) -> None: ...


def install(files: tuple[GuestFile, ...], tree: Path, at: str = "/") -> None:
    """Write ``files`` into ``tree``, which is the guest's directory ``at``."""
    for file in files:
        if os.path.commonpath([file.dest, at]) != at:
            raise ValueError(f"{file.dest} is not under {at}")
        target = tree / os.path.relpath(file.dest, at)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(file.read())
        target.chmod(file.mode)


def digest(h: Hash, files: tuple[GuestFile, ...]) -> None:
    """Feed ``h`` what ``files`` are: each one's path, mode and content."""
    for file in files:
        h.update(f"{file.dest}\0{file.mode:o}\0".encode() + file.read() + b"\0")
