"""``sandbox.files``: read, write, upload and download a sandbox's files, of any size."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, TypeGuard, overload

from forkd.client.connection import JSONDict
from forkd.client.local_file import staged_file
from forkd.client.tar_stream import CHUNK_BYTES, extract_chunks, tar_chunks

if TYPE_CHECKING:
    from forkd.client.controller import Controller
    from forkd.client.sandbox import Sandbox

# Told the bytes moved so far and the total (None: not known, as for a directory), per chunk.
Progress = Callable[[int, int | None], None]
WriteData = bytes | bytearray | memoryview | str | BinaryIO | Iterable[bytes]


def _file_chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK_BYTES):
        yield chunk


def _counted(
    chunks: Iterable[bytes], progress: Progress | None, total: int | None = None
) -> Iterator[bytes]:
    moved = 0
    for chunk in chunks:
        moved += len(chunk)
        yield chunk
        if progress is not None:
            progress(moved, total)


def _body(data: WriteData) -> bytes | Iterable[bytes]:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if _is_file(data):
        return _file_chunks(data)
    return data


def _is_file(data: BinaryIO | Iterable[bytes]) -> TypeGuard[BinaryIO]:
    """A file, told from chunks by its ``read`` (a file is an iterable too: of lines)."""
    return hasattr(data, "read")


class Files:
    """``sandbox.files``: the sandbox's filesystem. Transfers stream in chunks, so a
    file may be as large as the guest's free space (a full disk is a 507 error)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    @property
    def _ctl(self) -> Controller:
        return self._sandbox.controller

    @overload
    def read(self, path: str, format: Literal["bytes"] = "bytes") -> bytes: ...
    @overload
    def read(self, path: str, format: Literal["text"]) -> str: ...
    @overload
    def read(self, path: str, format: Literal["stream"]) -> Iterator[bytes]: ...

    def read(self, path: str, format: str = "bytes") -> bytes | str | Iterator[bytes]:
        """The file's contents: ``bytes``, ``text`` (UTF-8), or ``stream``, an iterator
        of chunks that holds one chunk in memory at a time.

        Example::

            with open("big.bin", "wb") as f:
                for chunk in sb.files.read("/data/big.bin", format="stream"):
                    f.write(chunk)
        """
        if format == "stream":
            return self._stream(path)
        if format not in ("bytes", "text"):
            raise ValueError(f"format must be 'bytes', 'text' or 'stream', not {format!r}")
        data = b"".join(self._stream(path))
        return data.decode("utf-8") if format == "text" else data

    def _stream(
        self, path: str, tar: bool = False, progress: Progress | None = None
    ) -> Iterator[bytes]:
        with self._ctl.download_file(self._sandbox.id, path, tar=tar) as (size, chunks):
            yield from _counted(chunks, progress, size)

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The file's contents, decoded."""
        return b"".join(self._stream(path)).decode(encoding)

    def write(self, path: str, data: WriteData) -> JSONDict:
        """Create or replace a file, atomically: a reader sees the old file or the whole
        new one. ``data``: bytes, a str (written as UTF-8), a binary file object, or an
        iterable of byte chunks. → ``{"path", "size"}``."""
        return self._ctl.upload_file(self._sandbox.id, path, _body(data))

    def upload(
        self, local_path: str | os.PathLike[str], path: str, progress: Progress | None = None
    ) -> JSONDict:
        """Copy a local file to ``path`` in the sandbox, or a local directory's content
        into the directory ``path`` (as a tar stream; created if missing)."""
        local = Path(local_path)
        if local.is_dir():
            chunks = _counted(tar_chunks(local), progress)
            return self._ctl.upload_file(self._sandbox.id, path, chunks, tar=True)
        with local.open("rb") as f:
            chunks = _counted(_file_chunks(f), progress, os.fstat(f.fileno()).st_size)
            return self._ctl.upload_file(self._sandbox.id, path, chunks)

    def download(
        self,
        path: str,
        local_path: str | os.PathLike[str],
        *,
        directory: bool = False,
        progress: Progress | None = None,
    ) -> int:
        """Copy the file ``path`` to ``local_path`` (replaced only once all of it came),
        or with ``directory`` the directory's content into the local directory
        ``local_path``. → bytes received."""
        local = Path(local_path)
        moved = 0

        def note(n: int, total: int | None) -> None:
            nonlocal moved
            moved = n
            if progress is not None:
                progress(n, total)

        if directory:
            extract_chunks(self._stream(path, tar=True, progress=note), local)
            return moved
        with staged_file(local) as f:
            for chunk in self._stream(path, progress=note):
                f.write(chunk)
        return moved

    def list(self, path: str) -> list[JSONDict]:
        """Entries of a directory: ``{"name", "type", "size", "mode", "mtime"}``."""
        return self._ctl.list_files(self._sandbox.id, path)

    def remove(self, path: str, recursive: bool = False) -> None:
        """Delete a file (or a directory tree with ``recursive=True``)."""
        self._ctl.remove_file(self._sandbox.id, path, recursive=recursive)
