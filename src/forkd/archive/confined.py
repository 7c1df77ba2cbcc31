"""The extractor as a process of its own, dropped to an unprivileged uid before it
reads a byte: ``python -m forkd.archive.confined``.

A daemon running as root unpacks a client's archive (a volume's content)
through this, so that a flaw in the extractor would act with a uid that owns
nothing on the host rather than as root. The parent opens the target
directory, hands its descriptor over (``--root-fd``, the only way in: the
directory's parents are closed to the uid), and gives the archive, plain or
gzip-compressed, on standard input. The child imports what it needs as root,
then drops to ``--uid``/``--gid`` with no supplementary groups, no
capabilities left (all of its uids are non-zero), ``no_new_privs`` and bounds
on its memory and descriptors, unpacks with the ``data`` policy, and writes
one JSON line on standard output: ``{"ok": true, "entries", "bytes", "uid"}``
or ``{"ok": false, "kind", "error"[, "errno"]}``. Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import io
import json
import os
import resource
import signal
import sys
import zlib
from typing import Any

from forkd.archive.errors import ArchiveError
from forkd.archive.tar_format import Limits
from forkd.archive.unpack import DATA, extract

GZIP_MAGIC = b"\x1f\x8b"
MEMORY_BYTES = 1 << 30  # the address space the child may map: headers are bounded far below
OPEN_FILES = 64
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``:``gid`` for good: no groups, no capabilities, no way back."""
    libc = ctypes.CDLL(None, use_errno=True)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # all uids non-zero: the kernel clears every capability
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    # A change of uid clears the parent-death signal: set it again, then make sure the
    # parent did not go meanwhile.
    parent = os.getppid()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def unpack_stdin(root_fd: int, limits: Limits) -> dict[str, Any]:
    """Unpack standard input (tar, or gzip of a tar) beneath ``root_fd``; the answer."""
    stdin = sys.stdin.buffer
    if not isinstance(stdin, io.BufferedReader):  # what Python makes of a process's stdin
        raise TypeError(f"standard input is a {type(stdin).__name__}, not a buffered reader")
    source: Any = (
        gzip.GzipFile(fileobj=stdin, mode="rb") if stdin.peek(2)[:2] == GZIP_MAGIC else stdin
    )
    try:
        done = extract(source.read, root_fd, DATA, limits)
    except ArchiveError as exc:
        return {"ok": False, "kind": type(exc).__name__, "error": str(exc)}
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        return {"ok": False, "kind": "BadArchive", "error": f"gzip: {exc}"}
    except OSError as exc:
        return {"ok": False, "kind": "OSError", "errno": exc.errno, "error": exc.strerror or ""}
    return {"ok": True, "entries": done.entries, "bytes": done.bytes, "uid": os.geteuid()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forkd.archive.confined")
    parser.add_argument("--root-fd", type=int, required=True)
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--gid", type=int, required=True)
    parser.add_argument("--max-entries", type=int, required=True)
    parser.add_argument("--max-bytes", type=int, required=True)
    parser.add_argument("--max-header-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.uid <= 0 or args.gid <= 0:
        parser.error("--uid and --gid must name an unprivileged user")
    drop_privileges(args.uid, args.gid)
    limits = Limits(
        max_entries=args.max_entries,
        max_bytes=args.max_bytes,
        max_header_bytes=args.max_header_bytes,
    )
    answer = unpack_stdin(args.root_fd, limits)
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
