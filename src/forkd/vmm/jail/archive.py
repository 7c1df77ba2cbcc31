"""Unpacking a client's archive on the daemon's host as a uid of its own, not as root.

The parent side of :mod:`forkd.archive.confined`. A daemon running as root
takes a uid from the same host-wide registry its QEMUs drop into
(:mod:`forkd.vmm.jail.qemu_user`), gives the (empty, fresh) target directory to
that uid, starts the extractor as a child that drops to it before reading,
and once the child has exited gives every unpacked entry back to root (a
volume's files belong to root in the guest). A daemon that is not root, or
that keeps QEMU as its own user (``--qemu-user none``), unpacks in-process:
it has no privilege to shed.
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from forkd.archive import (
    DATA,
    ArchiveError,
    ArchiveTooLarge,
    BadArchive,
    Extracted,
    Limits,
    UnsafeEntry,
    extract,
)
from forkd.vmm.jail import qemu_user

GZIP_MAGIC = b"\x1f\x8b"
_KINDS: dict[str, type[ArchiveError]] = {
    "ArchiveTooLarge": ArchiveTooLarge,
    "BadArchive": BadArchive,
    "UnsafeEntry": UnsafeEntry,
}


def unpack(content: Path | bytes, tree: Path, limits: Limits) -> Extracted:
    """Unpack ``content`` (a tar archive, plain or gzip, as a file or its bytes) into
    the empty directory ``tree``; an ArchiveError for an archive refused, OSError for
    the host's failures (a full disk)."""
    lease = qemu_user.reserve()
    if lease is None:
        return _in_process(content, tree, limits)
    try:
        return _in_child(content, tree, limits, lease.uid, lease.gid)
    finally:
        lease.release()


def _in_process(content: Path | bytes, tree: Path, limits: Limits) -> Extracted:
    raw: BinaryIO = io.BytesIO(content) if isinstance(content, bytes) else content.open("rb")
    with raw:
        magic = raw.read(2)
        raw.seek(0)
        stream: Any = gzip.GzipFile(fileobj=raw, mode="rb") if magic == GZIP_MAGIC else raw
        try:
            return extract(stream.read, tree, DATA, limits)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise BadArchive(f"gzip: {exc}") from exc


def _in_child(content: Path | bytes, tree: Path, limits: Limits, uid: int, gid: int) -> Extracted:
    root = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(root, uid, gid)
        os.fchmod(root, 0o700)
        argv = [
            sys.executable,
            "-m",
            "forkd.archive.confined",
            "--root-fd",
            str(root),
            "--uid",
            str(uid),
            "--gid",
            str(gid),
            "--max-entries",
            str(limits.max_entries),
            "--max-bytes",
            str(limits.max_bytes),
            "--max-header-bytes",
            str(limits.max_header_bytes),
        ]
        try:
            if isinstance(content, bytes):
                proc = subprocess.run(
                    argv, input=content, capture_output=True, pass_fds=(root,), check=False
                )
            else:
                with content.open("rb") as source:
                    proc = subprocess.run(
                        argv, stdin=source, capture_output=True, pass_fds=(root,), check=False
                    )
            return _answer(proc)
        finally:
            _give_back_to_root(root)
    finally:
        os.close(root)


def _answer(proc: subprocess.CompletedProcess[bytes]) -> Extracted:
    try:
        answer = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise OSError(
            errno.EIO,
            f"the archive extractor exited {proc.returncode} without an answer: "
            f"{proc.stderr.decode(errors='replace').strip()[-500:]}",
        ) from None
    if answer.get("ok"):
        return Extracted(int(answer["entries"]), int(answer["bytes"]))
    kind = answer.get("kind")
    if kind in _KINDS:
        raise _KINDS[kind](str(answer.get("error")))
    raise OSError(int(answer.get("errno") or errno.EIO), str(answer.get("error")))


def _give_back_to_root(root: int) -> None:
    """Every entry beneath ``root`` to root:root, links themselves not followed (the
    child is gone: nothing else writes here)."""
    os.fchown(root, 0, 0)
    for _dirpath, dirnames, filenames, dir_fd in os.fwalk(dir_fd=root, follow_symlinks=False):
        for name in (*dirnames, *filenames):
            os.chown(name, 0, 0, dir_fd=dir_fd, follow_symlinks=False)
