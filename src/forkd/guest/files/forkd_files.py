"""Chunked file transfers of the forkd guest agent: staged uploads, ranged reads, tar streams.

Imported by forkd_agent_protocol.py, which merges :data:`OPS` into its table (ops
``file_upload_*``, ``file_read_range``, ``file_tar_*``; see
docs/guest-agent.md). Standard library only, like the agent.

An upload is written to a hidden file beside its target and renamed into
place by its commit, so a reader sees the old file or the whole new one,
never a part. A tar upload is extracted as it streams in, member by member,
and never writes outside its target directory (forkd_tar.py, beside this
file). Every transfer is memory of the agent: a host that vanishes, or a fork
of the VM mid-transfer, leaves it open, so at most :data:`MAX_OPEN` are kept
and one idle for :data:`IDLE_SECS` is dropped (its staged file removed).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

# The tar errors are answered by their names (docs/guest-agent.md): re-exported here.
from forkd_tar import BadArchiveError as BadArchiveError
from forkd_tar import UnsafeArchiveError as UnsafeArchiveError
from forkd_tar import extract_tar, write_all, write_paths_tar, write_tar

from forkd import agent_wire as wire
from forkd.agent_wire import MAX_CHUNK_BYTES

MAX_OPEN = 16  # transfers open at once
IDLE_SECS = 300.0  # a transfer untouched this long is dropped
SWEEP_SECS = 30.0  # how often idle transfers are looked for
STAGED_PREFIX = ".forkd-upload-"
DEFAULT_MODE = 0o644
JOIN_SECS = 30.0  # for a tar thread to finish once its pipe is closed
TURN_WAIT_SECS = 30.0  # a chunk that arrived early waits this long for the ones before it
DRAIN_CHUNK = 64 * 1024  # read at a time from what follows a tar's end


class EncodedJSON(list[bytes]):
    """An op's result already encoded as one JSON object, in pieces: answered as it
    is, joined once with the answer around it (each copy of a large answer costs)."""


class WithRawBytes(EncodedJSON):
    """An encoded result whose ``raw`` bytes are sent after the answer's line as they
    are, announced by ``"raw":K`` second in it (no base64 to make)."""

    def __init__(self, parts: list[bytes], raw: list[bytes]) -> None:
        super().__init__(parts)
        self.raw = raw


def _with_data(req: dict[str, Any], data: bytes, rest: dict[str, Any]) -> EncodedJSON:
    """``rest`` and the data: raw after the answer's line when the request asks for
    ``raw``, else ``"data": <base64>``, built by hand (json.dumps would walk every
    character of the base64 again, which under TCG costs more than reading the file)."""
    if req.get("raw") is True:
        encoded = json.dumps({**rest, "length": len(data)}, separators=(",", ":"))
        return WithRawBytes([encoded.encode("ascii")], [data])
    tail = json.dumps(rest, separators=(",", ":")).encode("ascii")
    return EncodedJSON([b'{"data":"', binascii.b2a_base64(data, newline=False), b'",', tail[1:]])


class NoSpaceError(OSError):
    """The guest's disk (or quota) is full; what was being written was removed."""


class TransferGone(LookupError):
    """No open transfer has this id: never opened, finished, or dropped when idle."""


def _path(req: dict[str, Any], name: str = "path") -> str:
    value = req.get(name)
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise ValueError(f"{name!r} must be an absolute path without NUL bytes")
    return value


def _int(req: dict[str, Any], name: str, low: int, high: float = float("inf")) -> int:
    value = req.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        bounds = f">= {low}" if high == float("inf") else f"from {low} to {high}"
        raise ValueError(f"{name!r} must be an integer {bounds}")
    return value


def _mode(req: dict[str, Any]) -> int | None:
    if req.get("mode") is None:
        return None
    return _int(req, "mode", 0, 0o7777)


def _chunk(req: dict[str, Any]) -> bytes | bytearray:
    """The request's chunk: the payload sent raw after its line, or ``data`` in base64."""
    data = req.get("data")
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"'data' is not valid base64: {exc}") from None
    elif not isinstance(data, bytes | bytearray):  # a payload: bytes no JSON line holds
        raise ValueError("'data' must be a base64 string")
    if len(data) > MAX_CHUNK_BYTES:
        raise ValueError(f"'data' is larger than {MAX_CHUNK_BYTES} bytes")
    return data


def _out_of_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


# --------------------------------------------------------------------------- transfers


class Transfer:
    """One open transfer; its table serialises calls to it under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.used_at = time.monotonic()
        self.size = 0  # bytes written so far (uploads)
        self.fd: int | None = None

    def _wait_turn(self, offset: int) -> None:
        """Each request runs on its own thread, so a host with two chunks in flight
        may see the second taken first: it waits, the lock released, for its turn."""
        if offset > self.size:
            self.lock.wait_for(lambda: self.size >= offset or self.fd is None, TURN_WAIT_SECS)
        if self.fd is None:
            raise TransferGone("this upload is finished")
        if offset != self.size:
            raise ValueError(f"'offset' {offset} is not the upload's size so far ({self.size})")

    def _wrote(self, data: bytes | bytearray) -> int:
        self.size += len(data)
        self.lock.notify_all()
        return self.size

    def write(self, offset: int, data: bytes | bytearray) -> int:
        raise ValueError("this transfer is not an upload")

    def read(self, length: int) -> tuple[bytes, bool]:
        raise ValueError("this transfer is not a download")

    def commit(self) -> wire.CommitAnswer:
        raise ValueError("this transfer is not an upload")

    def abort(self) -> None:
        """Drop the transfer and whatever it staged; never raises."""


class StagedUpload(Transfer):
    """A file written to a hidden sibling of its target, renamed into place by the commit.

    The target's mode is kept when it exists and no mode is given; a symlink
    target is written through, as open() would, not replaced.
    """

    def __init__(self, path: str, mode: int | None) -> None:
        super().__init__()
        target = os.path.realpath(path) if os.path.islink(path) else path
        if os.path.isdir(target):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        parent = os.path.dirname(target) or "/"
        os.makedirs(parent, exist_ok=True)
        if mode is None:
            try:
                mode = stat.S_IMODE(os.stat(target).st_mode)
            except FileNotFoundError:
                mode = DEFAULT_MODE
        self.target = target
        self.staged = os.path.join(parent, f"{STAGED_PREFIX}{secrets.token_hex(8)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(self.staged, flags, 0o600)
        try:
            os.fchmod(self.fd, mode)  # the umask must not change the file's mode
        except BaseException:
            self.abort()
            raise

    def write(self, offset: int, data: bytes | bytearray) -> int:
        self._wait_turn(offset)
        assert self.fd is not None
        try:
            write_all(self.fd, data)
        except OSError as exc:
            self._fail(exc)
        return self._wrote(data)

    def commit(self) -> wire.CommitAnswer:
        if self.fd is None:
            raise TransferGone("this upload is finished")
        try:
            os.fsync(self.fd)  # a full disk may show only now (delayed allocation)
            os.close(self.fd)
            self.fd = None
            os.replace(self.staged, self.target)
        except OSError as exc:
            self._fail(exc)
        return {"path": self.target, "size": self.size}

    def abort(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        with contextlib.suppress(OSError):
            os.unlink(self.staged)

    def _fail(self, exc: OSError) -> None:
        self.abort()
        if _out_of_space(exc):
            raise NoSpaceError(
                exc.errno, f"the guest's disk is full writing {self.target}; nothing was kept"
            ) from None
        raise exc


class _PipeTransfer(Transfer):
    """A transfer whose other end is a tar thread behind an os.pipe."""

    def __init__(self, work: Callable[[BinaryIO], None], mode: str) -> None:
        super().__init__()
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, False)
        os.set_inheritable(write_fd, False)
        ours, theirs = (write_fd, read_fd) if mode == "rb" else (read_fd, write_fd)
        self.fd = ours
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(work, os.fdopen(theirs, mode)), daemon=True
        )
        self.thread.start()

    def _run(self, work: Callable[[BinaryIO], None], pipe: BinaryIO) -> None:
        try:
            with pipe:
                work(pipe)
        except BaseException as exc:  # reported to the host by the next call
            self.error = exc

    def _close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def _finish(self) -> None:
        self._close()
        self.thread.join(JOIN_SECS)
        if isinstance(self.error, OSError) and _out_of_space(self.error):
            raise NoSpaceError(self.error.errno, f"the guest's disk is full: {self.error}")
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        self._close()


def _extract_then_drain(pipe: BinaryIO, dest: str) -> None:
    """Extract, then read what follows the archive's end to the sender's close: a
    tar's end marker is followed by padding, and closing the pipe early would
    fail the upload's next write with a broken pipe."""
    extract_tar(pipe, dest)
    while pipe.read(DRAIN_CHUNK):
        pass


class TarExtract(_PipeTransfer):
    """A tar stream extracted into a directory as it arrives."""

    def __init__(self, dest: str) -> None:
        os.makedirs(dest, exist_ok=True)
        self.dest = dest
        super().__init__(lambda pipe: _extract_then_drain(pipe, dest), "rb")

    def write(self, offset: int, data: bytes | bytearray) -> int:
        self._wait_turn(offset)
        assert self.fd is not None
        try:
            write_all(self.fd, data)
        except BrokenPipeError:  # the extraction stopped: say why
            self._finish()
            raise
        return self._wrote(data)

    def commit(self) -> wire.CommitAnswer:
        self._finish()
        return {"path": self.dest, "size": self.size}


class ReadStream(_PipeTransfer):
    """Bytes a thread writes (``work``), read in chunks."""

    def __init__(self, work: Callable[[BinaryIO], None]) -> None:
        super().__init__(work, "wb")

    def read(self, length: int) -> tuple[bytes, bool]:
        if self.fd is None:
            raise TransferGone("this download is finished")
        pieces: list[bytes] = []
        wanted = length
        while wanted > 0:
            piece = os.read(self.fd, wanted)
            if not piece:
                self._finish()
                return b"".join(pieces), True
            pieces.append(piece)
            wanted -= len(piece)
        return b"".join(pieces), False


class TarStream(ReadStream):
    """A tar stream of a directory's content, read in chunks."""

    def __init__(self, path: str) -> None:
        if not stat.S_ISDIR(os.stat(path).st_mode):  # FileNotFoundError now, not in the thread
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        super().__init__(lambda pipe: write_tar(pipe, path))


class PathsTarStream(ReadStream):
    """A tar stream of the files at ``paths`` (members named by their paths, without
    the leading slash; a directory as itself, not its content; one gone meanwhile is
    left out)."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__(lambda pipe: write_paths_tar(pipe, paths))


# --------------------------------------------------------------------------- the table


class TransferTable:
    """Open transfers by id, at most ``max_open``; idle ones are dropped by a sweeper thread."""

    def __init__(
        self,
        max_open: int = MAX_OPEN,
        idle_secs: float = IDLE_SECS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_open = max_open
        self._idle_secs = idle_secs
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[str, Transfer] = {}
        self._sweeper: threading.Thread | None = None

    def add(self, make: Callable[[], Transfer]) -> str:
        self.sweep()
        with self._lock:
            if len(self._by_id) >= self._max_open:
                raise BlockingIOError(f"too many file transfers open (at most {self._max_open})")
            transfer = make()
            transfer.used_at = self._clock()
            transfer_id = secrets.token_hex(8)
            self._by_id[transfer_id] = transfer
            if self._sweeper is None or not self._sweeper.is_alive():
                self._sweeper = threading.Thread(target=self._sweep_forever, daemon=True)
                self._sweeper.start()
        return transfer_id

    @contextlib.contextmanager
    def use(self, transfer_id: object, finish: bool = False) -> Iterator[Transfer]:
        """The transfer, locked; with ``finish`` it leaves the table, whatever happens."""
        if not isinstance(transfer_id, str):
            raise ValueError("'transfer_id' must be a string")
        with self._lock:
            transfer = (
                self._by_id.pop(transfer_id, None) if finish else self._by_id.get(transfer_id)
            )
        if transfer is None:
            raise TransferGone(f"no open file transfer {transfer_id!r} (finished or expired)")
        with transfer.lock:
            try:
                yield transfer
            except BaseException:
                self._drop(transfer_id, transfer)
                raise
            finally:
                transfer.used_at = self._clock()

    def _drop(self, transfer_id: str, transfer: Transfer) -> None:
        with self._lock:
            if self._by_id.get(transfer_id) is transfer:
                del self._by_id[transfer_id]
        transfer.abort()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def sweep(self) -> int:
        """Drop the transfers idle longer than the limit; how many were dropped."""
        now = self._clock()
        with self._lock:
            idle = {k: t for k, t in self._by_id.items() if now - t.used_at > self._idle_secs}
            for transfer_id in idle:
                del self._by_id[transfer_id]
        for transfer in idle.values():
            transfer.abort()
        return len(idle)

    def _sweep_forever(self) -> None:
        while True:
            time.sleep(SWEEP_SECS)
            self.sweep()
            with self._lock:
                if not self._by_id:
                    self._sweeper = None
                    return


TRANSFERS = TransferTable()


# --------------------------------------------------------------------------- ops


def op_file_upload_open(req: dict[str, Any]) -> wire.UploadOpenAnswer:
    """Open an upload, with its first chunk if ``data`` is given; with ``commit`` too,
    a whole file in one request, never entered in the table."""
    path = _path(req)
    kind = req.get("format", "file")
    first = _chunk(req) if req.get("data") is not None else b""
    commit = req.get("commit", False)
    if not isinstance(commit, bool) or (commit and kind != "file"):
        raise ValueError("'commit' must be a boolean, and true only for a file")
    if kind == "file":
        mode = _mode(req)
        if commit:
            return _write_whole(StagedUpload(path, mode), first)
        transfer_id = TRANSFERS.add(lambda: StagedUpload(path, mode))
    elif kind == "tar":
        transfer_id = TRANSFERS.add(lambda: TarExtract(path))
    else:
        raise ValueError('\'format\' must be "file" or "tar"')
    if first:
        with TRANSFERS.use(transfer_id) as transfer:
            transfer.write(0, first)
    # "payload": this agent reads a chunk sent raw after its request's line.
    return {"transfer_id": transfer_id, "size": len(first), "payload": True}


def _write_whole(upload: StagedUpload, data: bytes | bytearray) -> wire.UploadOpenAnswer:
    with upload.lock:
        try:
            upload.write(0, data)
            committed = upload.commit()
            return {"size": committed["size"], "path": committed["path"]}
        except BaseException:
            upload.abort()
            raise


def op_file_upload_write(req: dict[str, Any]) -> wire.SizeAnswer:
    data = _chunk(req)
    offset = _int(req, "offset", 0)
    with TRANSFERS.use(req.get("transfer_id")) as transfer:
        return {"size": transfer.write(offset, data)}


def op_file_upload_commit(req: dict[str, Any]) -> wire.CommitAnswer:
    with TRANSFERS.use(req.get("transfer_id"), finish=True) as transfer:
        return transfer.commit()


def op_file_transfer_abort(req: dict[str, Any]) -> wire.AbortAnswer:
    try:
        with TRANSFERS.use(req.get("transfer_id"), finish=True) as transfer:
            transfer.abort()
    except TransferGone:
        return {"aborted": False}
    return {"aborted": True}


def op_file_read_range(req: dict[str, Any]) -> EncodedJSON:
    path = _path(req)
    offset = _int(req, "offset", 0)
    length = _int(req, "length", 1, MAX_CHUNK_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            raise ValueError(f"not a regular file: {path}")
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    regular = stat.S_ISREG(st.st_mode)
    eof = len(data) < length or (regular and 0 < st.st_size <= offset + len(data))
    return _with_data(req, data, {"size": st.st_size if regular else None, "eof": eof})


def op_file_tar_open(req: dict[str, Any]) -> wire.TransferIdAnswer:
    if req.get("paths") is not None:  # these files, not a directory's content
        paths = _paths(req)
        return {"transfer_id": TRANSFERS.add(lambda: PathsTarStream(paths))}
    path = _path(req)
    return {"transfer_id": TRANSFERS.add(lambda: TarStream(path))}


MAX_TAR_PATHS = 1_000_000


def _paths(req: dict[str, Any]) -> list[str]:
    value = req.get("paths")
    if not isinstance(value, list) or len(value) > MAX_TAR_PATHS:
        raise ValueError(f"'paths' must be a list of at most {MAX_TAR_PATHS} paths")
    return [_path({"path": p}, "path") for p in value]


def op_file_tar_read(req: dict[str, Any]) -> EncodedJSON:
    length = _int(req, "length", 1, MAX_CHUNK_BYTES)
    transfer_id = req.get("transfer_id")
    with TRANSFERS.use(transfer_id) as transfer:
        data, eof = transfer.read(length)
    if eof:
        with contextlib.suppress(TransferGone), TRANSFERS.use(transfer_id, finish=True):
            pass
    return _with_data(req, data, {"eof": eof})


OPS: dict[str, Callable[[dict[str, Any]], Mapping[str, object] | EncodedJSON]] = {
    "file_upload_open": op_file_upload_open,
    "file_upload_write": op_file_upload_write,
    "file_upload_commit": op_file_upload_commit,
    "file_transfer_abort": op_file_transfer_abort,
    "file_read_range": op_file_read_range,
    "file_tar_open": op_file_tar_open,
    "file_tar_read": op_file_tar_read,
}
