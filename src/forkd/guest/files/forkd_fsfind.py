"""The manifest of an overlay's upper layer listed by GNU ``find``, as raw records.

Under TCG the guest's Python is the cost of a manifest: one ``lstat`` and one
formatted line per entry, interpreted (forkd_fsdiff's ``Walk``: 5-6 s for 100 000
files). GNU ``find -printf`` does the same walk in C in about a third of that,
and its output goes to the host as it is: the host parses it
(forkd.controller.services.manifests.RecordReader), where Python is fast.

A record is six fields, each ended by a NUL::

    kind  size  mode(octal)  mtime(seconds.fraction)  path(relative)  link-target

``kind`` is find's ``%y`` (``f d l c b p s``...); ``path`` is relative to the asked
one (empty: the asked path itself). What find cannot tell is added by Python after
it, as records of the same shape, which take the place of find's for their path:

- the asked path itself (``Walk`` handles a removed ancestor the same way);
- a character device that is an overlay whiteout (device 0/0): kind ``-``;
- under an opaque directory, what the image holds and the upper layer does not:
  kind ``-``.

find writes the directories and character devices it meets to a second pipe, so
Python looks at those few only. The stream ends with ``E``, then the JSON end
object of the line format (``{"end", "truncated", "entries"}``). Standard library only.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

RECORD_FIELDS = 6
FORMAT = r"%y\0%s\0%m\0%T@\0%P\0%l\0"
MARKS = r"%y%P\0"  # directories and character devices, to the second pipe
CHUNK = 1 << 16
MAX_MARK_BYTES = 256 << 20  # find's marks: a path per directory (a manifest's are fewer)
MAX_ERROR_BYTES = 64 << 10
ABSENT = ["-", 0, 0, 0, None]  # a Walk's fields of what is not there
_gnu_find: dict[tuple[str, int, int], bool] = {}  # (path, mtime_ns, size): is GNU find


def gnu_find() -> str | None:
    """The path of ``find`` when it is GNU find (busybox's has no ``-printf``)."""
    found = shutil.which("find")
    if found is None:
        return None
    try:
        st = os.stat(found)
    except OSError:
        return None
    key = (found, st.st_mtime_ns, st.st_size)
    if key not in _gnu_find:
        try:
            out = subprocess.run([found, "--version"], capture_output=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = b""
        _gnu_find[key] = b"GNU findutils" in out
    return found if _gnu_find[key] else None


def record(rel: str, fields: list[Any]) -> bytes:
    """One record of Python's making, for ``rel`` with a Walk's fields."""
    kind, size, mode, mtime_ns, target = fields
    secs, frac = divmod(mtime_ns, 1_000_000_000)  # as find prints: seconds, then ns
    parts = [kind, str(size), f"{mode:o}", f"{secs}.{frac:09d}", rel, target or ""]
    return b"".join(os.fsencode(p) + b"\0" for p in parts)


class FindWalk:
    """The records of ``path``, at most ``limit`` (find's, then Python's)."""

    def __init__(self, find: str, walk: Any) -> None:  # a forkd_fsdiff.Walk
        self.find = find
        self.walk = walk
        self.count = 0
        self.truncated = False

    def write(self, pipe: BinaryIO) -> None:
        walk = self.walk
        top = walk.top_fields()
        if top is not None:
            self._extra(pipe, [record("", top)])
            if top[0] == "d":
                marks = self._find(pipe)
                self._extra(pipe, self._fixes(marks))
        end = {"end": True, "truncated": self.truncated, "entries": self.count}
        pipe.write(b"E\0" + json.dumps(end).encode() + b"\0")

    def _extra(self, pipe: BinaryIO, records: Iterable[bytes]) -> None:
        """Python's records, as many as there is room for."""
        batch: list[bytes] = []
        for one in records:
            if self.count >= self.walk.limit:
                self.truncated = True
                break
            self.count += 1
            batch.append(one)
            if len(batch) >= 512:
                pipe.write(b"".join(batch))
                batch.clear()
        pipe.write(b"".join(batch))

    def _find(self, pipe: BinaryIO) -> bytes:
        """Run find, its records to ``pipe``; what it wrote to the second pipe."""
        top = self.walk.upper + self.walk.path
        marks_r, marks_w = os.pipe()
        # /proc, not /dev/fd: a guest's devtmpfs has no /dev/fd link
        argv = [
            self.find,
            top,
            "-mindepth",
            "1",
            "(",
            "-type",
            "d",
            "-o",
            "-type",
            "c",
            ")",
            "-fprintf",
            f"/proc/self/fd/{marks_w}",
            MARKS,
            ",",
            "-printf",
            FORMAT,
        ]
        try:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                pass_fds=(marks_w,),
            )
        finally:
            os.close(marks_w)
        assert proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout.fileno(), proc.stderr.fileno()
        streams = {out: bytearray(), marks_r: bytearray(), err: bytearray()}
        try:
            with proc.stdout, proc.stderr:
                self._drain(out, err, pipe, streams)
        finally:
            os.close(marks_r)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if proc.returncode != 0 and not self.truncated and _not_only_vanished(streams[err]):
            said = bytes(streams[err][-500:]).decode(errors="replace").strip()
            raise OSError(f"find exited {proc.returncode}: {said}")
        return bytes(streams[marks_r])

    def _drain(self, out: int, err: int, pipe: BinaryIO, streams: dict[int, bytearray]) -> None:
        """find's records (``out``) to ``pipe``, whole ones and as many as there is room
        for; what it writes to the other ``streams``, into them (its errors, ``err``: the
        first ``MAX_ERROR_BYTES``), until find closes them all or the room is used up."""
        room = (self.walk.limit - self.count) * RECORD_FIELDS  # fields
        sent = 0
        with selectors.DefaultSelector() as sel:
            for fd in streams:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map() and not self.truncated:
                for key, _ in sel.select():
                    data = os.read(key.fd, CHUNK)
                    if not data:
                        sel.unregister(key.fd)
                    elif key.fd != out:
                        kept = streams[key.fd]
                        if key.fd == err:
                            kept += data[: max(0, MAX_ERROR_BYTES - len(kept))]
                        elif len(kept) + len(data) > MAX_MARK_BYTES:  # not lose a whiteout
                            raise OSError(f"over {MAX_MARK_BYTES} bytes of directory names")
                        else:
                            kept += data
                    elif sent + data.count(b"\0") <= room:
                        sent += data.count(b"\0")
                        pipe.write(data)
                    else:  # the last record that fits ends at the room's last NUL
                        cut = -1
                        for _ in range(room - sent):
                            cut = data.index(b"\0", cut + 1)
                        pipe.write(data[: cut + 1])
                        sent, self.truncated = room, True
                        break
        self.count += sent // RECORD_FIELDS

    def _fixes(self, marks: bytes) -> Iterator[bytes]:
        """Python's records for what find cannot tell: whiteouts, and what opaque
        directories hide (the asked one included)."""
        walk = self.walk
        base = "" if walk.path == "/" else walk.path
        for mark in [b"d", *marks.split(b"\0")[:-1]]:
            kind, rel = chr(mark[0]), os.fsdecode(mark[1:])
            at = f"{base}/{rel}" if rel else walk.path
            if kind == "c":
                fields = walk.fields(at)
                if fields is not None and fields[0] == "-":  # a whiteout
                    yield record(rel, fields)
            elif kind == "d" and walk.opaque(at):
                for hidden in walk.hidden_paths(at):
                    yield record(hidden[len(base) + 1 :], ABSENT)


def _not_only_vanished(errors: bytearray) -> bool:
    """Whether find complained of more than entries gone while it walked (the sandbox
    runs on meanwhile; forkd_fsdiff's walk skips those too)."""
    lines = [line for line in errors.splitlines() if line.strip()]
    return not lines or any(not line.endswith(b"No such file or directory") for line in lines)
