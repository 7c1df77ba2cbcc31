"""The guest agent's chunked transfers (ops ``file_upload_*``, ``file_read_range``), played
in-process for FakeVM over its dict of files.

An upload is staged apart from the files and lands only at its commit, as
the agent's hidden sibling file does; ``disk_bytes`` plays the guest's disk:
a write past it fails with the agent's ``NoSpaceError`` and drops the upload.
Tar transfers are real tar streams built and read with ``tarfile`` over the same
dict, with the agent's refusals (not a tar, a member outside the destination).
"""

from __future__ import annotations

import io
import itertools
import json
import posixpath
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Any

from forkd import agent_wire as wire
from forkd.errors import AgentError

MAX_CHUNK_BYTES = wire.MAX_CHUNK_BYTES


@dataclass
class FakeTransfers:
    files: dict[str, bytes]
    disk_bytes: int | None = None  # free space for staged uploads; None: unbounded
    legacy: bool = False  # an agent older than the chunked ops: it knows none of them
    staged: dict[str, tuple[str, bytearray]] = field(default_factory=dict)
    tars: dict[str, tuple[set[str], bytearray]] = field(default_factory=dict)  # staged tars
    tar_reads: dict[str, io.BytesIO] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)  # of every write, in order
    opened: list[tuple[int, bool]] = field(default_factory=list)  # (first chunk, commit)
    payloads: list[bool] = field(default_factory=list)  # of every write: sent raw?
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def open(self, path: str, tar: bool, first: bytes, commit: bool) -> dict[str, Any]:
        """Open with the first chunk; with ``commit``, the whole file at once."""
        self._known("file_upload_open")
        if path.startswith("/proc/"):
            raise AgentError(f"[Errno 13] Permission denied: {path!r}", kind="PermissionError")
        transfer_id = f"t{next(self._ids)}"
        self.staged[transfer_id] = (path, bytearray())
        if tar:
            self.tars[transfer_id] = (set(), bytearray())
        self.opened.append((len(first), commit))
        size = self.write(transfer_id, 0, first) if first else 0
        if commit:
            return {"path": path, "size": self.commit(transfer_id)}
        return {"transfer_id": transfer_id, "size": size, "payload": True}

    def _known(self, op: str) -> None:
        if self.legacy:
            raise AgentError(f"unknown op: {op!r}", kind="ValueError")

    def _get(self, transfer_id: str) -> tuple[str, bytearray]:
        if transfer_id not in self.staged:
            raise AgentError(f"no open file transfer {transfer_id!r}", kind="TransferGone")
        return self.staged[transfer_id]

    def write(self, transfer_id: str, offset: int, data: bytes) -> int:
        path, staged = self._get(transfer_id)
        if len(data) > MAX_CHUNK_BYTES or offset != len(staged):
            raise AgentError("bad chunk", kind="ValueError")
        self.chunk_sizes.append(len(data))
        if self.disk_bytes is not None and len(staged) + len(data) > self.disk_bytes:
            del self.staged[transfer_id]
            raise AgentError(
                f"[Errno 28] the guest's disk is full writing {path}", kind="NoSpaceError"
            )
        staged += data
        return len(staged)

    def commit(self, transfer_id: str) -> int:
        path, staged = self._get(transfer_id)
        del self.staged[transfer_id]
        if self.tars.pop(transfer_id, None) is not None:
            self.files.update(_extracted(path, bytes(staged)))
        else:
            self.files[path] = bytes(staged)
        return len(staged)

    def abort(self, transfer_id: str) -> None:
        self._known("file_transfer_abort")
        self.aborted.append(transfer_id)
        self.staged.pop(transfer_id, None)
        self.tars.pop(transfer_id, None)
        self.tar_reads.pop(transfer_id, None)

    def read(self, path: str, offset: int, length: int) -> tuple[bytes, int | None, bool]:
        self._known("file_read_range")
        if path not in self.files:
            raise AgentError(
                f"[Errno 2] No such file or directory: {path!r}", kind="FileNotFoundError"
            )
        data = self.files[path][offset : offset + min(length, MAX_CHUNK_BYTES)]
        size = len(self.files[path])
        return data, size, offset + len(data) >= size

    def tar_open(self, path: str) -> str:
        """A tar of the file at ``path`` or of every file under it, as the agent streams it."""
        self._known("file_tar_open")
        prefix = path.rstrip("/") + "/"
        members = {
            name: data
            for name, data in self.files.items()
            if name == path or name.startswith(prefix)
        }
        if not members:
            raise AgentError(
                f"[Errno 2] No such file or directory: {path!r}", kind="FileNotFoundError"
            )
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            base = posixpath.dirname(path.rstrip("/")) or "/"
            for name, data in sorted(members.items()):
                info = tarfile.TarInfo(posixpath.relpath(name, base))
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        out.seek(0)
        transfer_id = f"t{next(self._ids)}"
        self.tar_reads[transfer_id] = out
        return transfer_id

    def tar_open_paths(self, paths: list[str]) -> str:
        """A tar of the files at ``paths``, each named by its path without the slash."""
        self._known("file_tar_open")
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for name in paths:
                if name in self.files:
                    info = tarfile.TarInfo(name.lstrip("/"))
                    info.size = len(self.files[name])
                    tar.addfile(info, io.BytesIO(self.files[name]))
        return self._reading(out.getvalue())

    def manifest_open(self, path: str, max_entries: int) -> dict[str, Any]:
        """What the agent's fs_manifest_open lists, of a guest whose image is empty: every
        file is in the upper layer; its crc32 stands for its mtime."""
        self._known("fs_manifest_open")
        prefix = path.rstrip("/") + "/"
        names = sorted(n for n in self.files if n == path or n.startswith(prefix))
        lines = [
            json.dumps([n, "f", len(self.files[n]), 0o644, zlib.crc32(self.files[n]), None])
            for n in names[:max_entries]
        ]
        end = {"end": True, "truncated": len(names) > max_entries, "entries": len(lines)}
        lines.append(json.dumps(end))
        return {"transfer_id": self._reading("\n".join(lines).encode() + b"\n"), "lower": "/lower"}

    def _reading(self, data: bytes) -> str:
        transfer_id = f"t{next(self._ids)}"
        self.tar_reads[transfer_id] = io.BytesIO(data)
        return transfer_id

    def tar_read(self, transfer_id: str, length: int) -> tuple[bytes, bool]:
        if transfer_id not in self.tar_reads:
            raise AgentError(f"no open file transfer {transfer_id!r}", kind="TransferGone")
        stream = self.tar_reads[transfer_id]
        data = stream.read(min(length, MAX_CHUNK_BYTES))
        eof = stream.tell() >= len(stream.getbuffer())
        if eof:
            del self.tar_reads[transfer_id]
        return data, eof


def _extracted(dest: str, archive: bytes) -> dict[str, bytes]:
    """The regular files of ``archive`` under ``dest``, refused as the agent refuses."""
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            for member in tar:
                name = posixpath.normpath(member.name)
                if name.startswith(("/", "..")):
                    raise AgentError(
                        f"refusing tar member {member.name!r}: absolute or with '..'",
                        kind="UnsafeArchiveError",
                    )
                if member.isfile():
                    source = tar.extractfile(member)
                    files[posixpath.join(dest, name)] = source.read() if source else b""
    except tarfile.TarError as exc:
        raise AgentError(f"not a valid tar archive: {exc}", kind="BadArchiveError") from None
    return files
