"""The guest agent's chunked transfers (ops ``file_upload_*``, ``file_read_range``), played
in-process for FakeVM over its dict of files.

An upload is staged apart from the files and lands only at its commit, as
the agent's hidden sibling file does; ``disk_bytes`` plays the guest's disk:
a write past it fails with the agent's ``NoSpaceError`` and drops the upload.
Tar transfers are not played (real VMs test them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from forkd.errors import AgentError

MAX_CHUNK_BYTES = 1 << 20


@dataclass
class FakeTransfers:
    files: dict[str, bytes]
    disk_bytes: int | None = None  # free space for staged uploads; None: unbounded
    legacy: bool = False  # an agent older than the chunked ops: it knows none of them
    staged: dict[str, tuple[str, bytearray]] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)  # of every write, in order
    opened: list[tuple[int, bool]] = field(default_factory=list)  # (first chunk, commit)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def open(self, path: str, tar: bool, first: bytes, commit: bool) -> dict[str, Any]:
        """Open with the first chunk; with ``commit``, the whole file at once."""
        self._known("file_upload_open")
        if tar:
            raise AgentError("tar transfers are not played by the fake guest", kind="ValueError")
        if path.startswith("/proc/"):
            raise AgentError(f"[Errno 13] Permission denied: {path!r}", kind="PermissionError")
        transfer_id = f"t{next(self._ids)}"
        self.staged[transfer_id] = (path, bytearray())
        self.opened.append((len(first), commit))
        size = self.write(transfer_id, 0, first) if first else 0
        if commit:
            return {"path": path, "size": self.commit(transfer_id)}
        return {"transfer_id": transfer_id, "size": size}

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
            raise AgentError(f"[Errno 28] the guest's disk is full writing {path}",
                             kind="NoSpaceError")  # fmt: skip
        staged += data
        return len(staged)

    def commit(self, transfer_id: str) -> int:
        path, staged = self._get(transfer_id)
        del self.staged[transfer_id]
        self.files[path] = bytes(staged)
        return len(staged)

    def abort(self, transfer_id: str) -> None:
        self._known("file_transfer_abort")
        self.aborted.append(transfer_id)
        self.staged.pop(transfer_id, None)

    def read(self, path: str, offset: int, length: int) -> tuple[bytes, int | None, bool]:
        self._known("file_read_range")
        if path not in self.files:
            raise AgentError(f"[Errno 2] No such file or directory: {path!r}",
                             kind="FileNotFoundError")  # fmt: skip
        data = self.files[path][offset : offset + min(length, MAX_CHUNK_BYTES)]
        size = len(self.files[path])
        return data, size, offset + len(data) >= size
