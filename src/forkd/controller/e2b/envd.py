"""What E2B's SDKs send to a sandbox's in-guest daemon, ``envd``, served by forkd at the
E2B port's root: ``/health`` and the ``/files`` routes (a file read whole, or written
from a multipart form or a raw body), for the sandbox the ``E2b-Sandbox-Id`` header
names and with the access token its creation handed out (``X-Access-Token``).

The files go through the daemon's own file transfers: streamed in chunks, bounded as
every upload and download is, the guest's answers checked as everywhere else.
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from python_multipart.multipart import MultipartParser, parse_options_header

from forkd.controller.bodies import receive_upload, stream_download
from forkd.controller.e2b.guest_values import text
from forkd.controller.e2b.gzip_body import content_encoding, inflated
from forkd.controller.e2b.rest import Svc
from forkd.controller.e2b.target import ENVD_PORT, sandbox_dependency
from forkd.controller.services import Services
from forkd.controller.store_rows import SandboxRow
from forkd.errors import GuestError, Invalid, UpstreamError
from forkd.states import SandboxState

MAX_PARTS = 64  # files of one multipart upload
MAX_PART_HEADER_BYTES = 8 << 10  # of one part's headers

envd = APIRouter()


Sandbox = Annotated[SandboxRow, Depends(sandbox_dependency(ENVD_PORT))]
PathQ = Annotated[str, Query(description="a path inside the sandbox; relative: the user's home's")]
UserQ = Annotated[str | None, Query(max_length=256, description="whose home a relative path is in")]


class GuestPaths:
    """A request's paths made absolute as envd does: a relative one is in the home of
    the user the request names (the image's user without one), asked of the guest once."""

    def __init__(self, svc: Services, sandbox_id: str, user: str | None) -> None:
        self.svc, self.sandbox_id, self.user = svc, sandbox_id, user
        self._home: str | None = None

    async def absolute(self, path: str) -> str:
        if path.startswith("/"):
            return path
        if self._home is None:
            user = self.user
            home = await self.svc.guest.call(
                self.sandbox_id, lambda vm: vm.guest.fs_stat(".", user)
            )
            if not home["path"].startswith("/"):
                raise GuestError("the guest answered a home directory that is not absolute")
            self._home = home["path"]
        return posixpath.normpath(posixpath.join(self._home, path))


@envd.get("/health", status_code=204)
async def health(sandbox: Sandbox) -> Response:
    if sandbox.state != SandboxState.RUNNING:
        raise UpstreamError(f"sandbox {sandbox.id!r} is not running")
    return Response(status_code=204)


@envd.get("/envs")
async def envs(sandbox: Sandbox, svc: Svc) -> Response:
    """The environment every command in the sandbox starts with (the image's, with the
    sandbox's envVars), as the guest's ``env`` prints it."""
    ran = await svc.guest.call(sandbox.id, lambda vm: vm.guest.exec(["env", "-0"], timeout=10))
    if ran["exit_code"] != 0:
        raise GuestError(f"env in the guest exited {ran['exit_code']}")
    pairs = (item.partition("=") for item in ran["stdout"].split("\0") if item)
    return JSONResponse({text(name): text(value) for name, sep, value in pairs if sep and name})


@envd.get("/files")
async def read(sandbox: Sandbox, svc: Svc, path: PathQ, username: UserQ = None) -> Response:
    absolute = await GuestPaths(svc, sandbox.id, username).absolute(path)
    download = await svc.files.download(sandbox.id, absolute)
    return stream_download(download, "application/octet-stream")


@envd.post("/files")
async def write(
    sandbox: Sandbox,
    svc: Svc,
    request: Request,
    path: Annotated[str | None, Query()] = None,
    username: UserQ = None,
) -> Response:
    """A multipart form (each part a file, named by its filename or ``path``) or a raw
    body (to ``path``); the answer lists what was written (absolute)."""
    paths = GuestPaths(svc, sandbox.id, username)
    if username is not None:
        await _check_user(svc, sandbox.id, username)
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    encoding = content_encoding(request.headers.get("content-encoding"))
    if kind == b"multipart/form-data":
        if encoding is not None:
            raise Invalid("a multipart body is sent as it is: gzip is for a raw body")
        boundary = options.get(b"boundary")
        if not boundary:
            raise Invalid("a multipart body without a boundary")
        written = await receive_upload(
            request, lambda body: _write_parts(svc, paths, body, boundary, path)
        )
    else:
        if path is None:
            raise Invalid("a raw upload needs ?path=")
        dest = await paths.absolute(path)
        limit: int = request.app.state.upload_limit

        def upload(body: AsyncIterator[bytes]) -> Awaitable[int]:
            plain = inflated(body, limit) if encoding == "gzip" else body
            return svc.files.upload(sandbox.id, dest, plain)

        await receive_upload(request, upload)
        written = [dest]
    if username is not None:
        await _own(svc, sandbox.id, written, username)
    entries = [{"name": posixpath.basename(p), "type": "file", "path": p} for p in written]
    return JSONResponse(entries)


async def _check_user(svc: Services, sandbox_id: str, user: str) -> None:
    """An unknown user is refused before anything is written."""
    argv = ["id", "-u", "--", user]
    ran = await svc.guest.call(sandbox_id, lambda vm: vm.guest.exec(argv, timeout=30))
    if ran["exit_code"] != 0:
        raise Invalid(f"no user {user!r} in the sandbox")


async def _own(svc: Services, sandbox_id: str, written: list[str], user: str) -> None:
    """The files written made the named user's (and their group's), as envd writes
    them as that user."""
    argv = ["chown", "-h", "--", f"{user}:", *written]  # -h: a link, never what it names
    ran = await svc.guest.call(sandbox_id, lambda vm: vm.guest.exec(argv, timeout=30, user="root"))
    if ran["exit_code"] != 0:
        raise GuestError(f"the files could not be given to {user!r}: {ran['stderr'][-300:]}")


async def _write_parts(
    svc: Services, paths: GuestPaths, body: AsyncIterator[bytes], boundary: bytes, path: str | None
) -> list[str]:
    """Each part of the form written to its file, one after the other, as it arrives."""
    parts = _Parts(body, boundary)
    written: list[str] = []
    while (part := await parts.next_part()) is not None:
        if len(written) >= MAX_PARTS:
            raise Invalid(f"more than {MAX_PARTS} files in one upload")
        dest = path if path is not None and not written else part
        if not dest:
            raise Invalid("a file part with no filename and no ?path=")
        dest = await paths.absolute(dest)
        await svc.files.upload(paths.sandbox_id, dest, parts.data())
        written.append(dest)
    if not written:
        raise Invalid("the form has no file")
    return written


class _Parts:
    """A multipart body, parsed as it streams in: each part's filename, then its data."""

    def __init__(self, body: AsyncIterator[bytes], boundary: bytes) -> None:
        self._chunks = body
        self._events: list[tuple[str, bytes]] = []
        self._header: list[bytes] = [b"", b""]
        self._header_bytes = 0
        self._filename = b""
        self._ended = False
        self._parser = MultipartParser(
            boundary,
            callbacks={
                "on_part_begin": self._begin,
                "on_header_field": lambda d, s, e: self._header_piece(0, d[s:e]),
                "on_header_value": lambda d, s, e: self._header_piece(1, d[s:e]),
                "on_header_end": self._header_end,
                "on_headers_finished": lambda: self._events.append(("part", self._filename)),
                "on_part_data": lambda d, s, e: self._events.append(("data", bytes(d[s:e]))),
                "on_part_end": lambda: self._events.append(("end", b"")),
                "on_end": self._end,
            },
        )

    def _begin(self) -> None:
        self._filename = b""
        self._header_bytes = 0

    def _header_piece(self, which: int, piece: bytes) -> None:
        self._header_bytes += len(piece)
        if self._header_bytes > MAX_PART_HEADER_BYTES:
            raise Invalid("a part's headers are too long")
        self._header[which] += piece

    def _header_end(self) -> None:
        field, value = self._header
        self._header = [b"", b""]
        if field.lower() == b"content-disposition":
            _, options = parse_options_header(value)
            self._filename = options.get(b"filename", b"")

    def _end(self) -> None:
        self._ended = True

    async def _event(self) -> tuple[str, bytes] | None:
        while not self._events:
            if self._ended:
                return None
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                if not self._ended:
                    raise Invalid("the multipart body ended before its last boundary") from None
                return None
            self._parser.write(chunk)
        return self._events.pop(0)

    async def next_part(self) -> str | None:
        """The next part's filename ('' for none); None after the last part."""
        while (event := await self._event()) is not None:
            if event[0] == "part":
                return event[1].decode("utf-8", "replace")
        return None

    async def data(self) -> AsyncIterator[bytes]:
        """This part's data, up to its end."""
        while (event := await self._event()) is not None:
            kind, value = event
            if kind == "end":
                return
            if kind == "data" and value:
                yield value
