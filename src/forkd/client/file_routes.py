"""A sandbox's files streamed both ways, as methods of :class:`~forkd.client.Controller`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from forkd.client.connection import JSONDict, json_of
from forkd.client.errors import ControllerError
from forkd.client.route_base import Call, RouteBase, content_of, entries_of, no_answer, route

CHUNK_BYTES = 1 << 20  # read from a local file per request-body piece


class FileRoutes(RouteBase):
    """Mixed into Controller: ``/v1/sandboxes/{id}/files``, never a whole file in memory."""

    _client: httpx.Client

    def upload_file(
        self,
        sandbox_id: str,
        path: str,
        content: bytes | bytearray | memoryview | Iterable[bytes],
        *,
        tar: bool = False,
    ) -> JSONDict:
        """``PUT /v1/sandboxes/{id}/files?path=[&format=tar]`` with the body streamed from
        ``content`` (bytes, or an iterable of byte chunks) → ``{"path", "size"}``.

        With ``tar`` the body is a tar archive, extracted into the directory ``path``.
        """
        params = {"path": path, "format": "tar" if tar else "file"}
        if isinstance(content, bytes | bytearray | memoryview):  # not iterated: ints
            body: bytes | Iterator[bytes] = bytes(content)
        else:
            body = _nonempty(content)
        with self._streamed("PUT", f"{self._sb(sandbox_id)}/files", params, body) as resp:
            resp.read()
            answer: JSONDict = json_of(resp, "PUT", "/files")
            return answer

    @contextlib.contextmanager
    def download_file(
        self, sandbox_id: str, path: str, *, tar: bool = False
    ) -> Iterator[tuple[int | None, Iterator[bytes]]]:
        """``GET /v1/sandboxes/{id}/files?path=[&format=tar]`` as ``(size, chunks)``; the
        answer stays open until the ``with`` ends. ``size`` is None for a tar."""
        params = {"path": path, "format": "tar" if tar else "file"}
        with self._streamed("GET", f"{self._sb(sandbox_id)}/files", params, None) as resp:
            length = resp.headers.get("content-length")
            size = int(length) if length is not None and length.isdigit() else None
            yield size, _checked(resp, size)

    @contextlib.contextmanager
    def _streamed(
        self, method: str, path: str, params: dict[str, Any], body: Any
    ) -> Iterator[httpx.Response]:
        """An answer whose body is read as it comes; a ControllerError unless it is 2xx."""
        request = file_request(self._client, method, path, params, body, self.timeout)
        try:
            resp = self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise ControllerError(0, f"{method} {path} to {self.url} failed: {exc!r}") from exc
        try:
            if not resp.is_success:
                resp.read()
                raise ControllerError.from_response(resp)
            yield resp
        finally:
            resp.close()


def file_request(
    client: httpx.Client | httpx.AsyncClient,
    method: str,
    path: str,
    params: dict[str, Any],
    body: Any,
    timeout: float,
) -> httpx.Request:
    """The request of a streamed file transfer (either client's)."""
    return client.build_request(
        method,
        path,
        params=params,
        content=body,
        headers={"Content-Type": "application/octet-stream"} if body is not None else None,
        timeout=timeout,
    )


def _nonempty(chunks: Iterable[bytes]) -> Iterator[bytes]:
    for chunk in chunks:
        if chunk:
            yield bytes(chunk)


def _checked(resp: httpx.Response, size: int | None) -> Iterator[bytes]:
    """The answer's body chunks; a ControllerError if it ends short of ``size``."""
    got = 0
    try:
        for chunk in resp.iter_bytes(CHUNK_BYTES):
            got += len(chunk)
            yield chunk
    except httpx.TransportError as exc:
        raise ControllerError(0, f"the download broke off after {got} bytes: {exc!r}") from exc
    if size is not None and got != size:
        raise ControllerError(0, f"the download ended after {got} of {size} bytes")


class FileCalls(RouteBase):
    """The JSON routes of files (:class:`~forkd.client.routes.Routes`)."""

    @route
    def read_file(self, sandbox_id: str, path: str) -> Call[bytes]:
        """``GET /v1/sandboxes/{id}/files?path=`` → the file's bytes."""
        resp = self._request("GET", f"{self._sb(sandbox_id)}/files", params={"path": path})
        return resp.then(content_of)

    @route
    def write_file(self, sandbox_id: str, path: str, data: bytes | str) -> Call[None]:
        """``PUT /v1/sandboxes/{id}/files?path=`` with the raw bytes (a str is
        written as UTF-8)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        resp = self._request(
            "PUT",
            f"{self._sb(sandbox_id)}/files",
            params={"path": path},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )
        return resp.then(no_answer)

    @route
    def list_files(self, sandbox_id: str, path: str) -> Call[list[JSONDict]]:
        """``GET /v1/sandboxes/{id}/files/list?path=`` → entries
        ``{"name", "type", "size", "mode", "mtime"}``."""
        body = self._json("GET", f"{self._sb(sandbox_id)}/files/list", params={"path": path})
        return body.then(entries_of)

    @route
    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> Call[None]:
        """``DELETE /v1/sandboxes/{id}/files?path=&recursive=true|false``."""
        resp = self._request(
            "DELETE",
            f"{self._sb(sandbox_id)}/files",
            params={"path": path, "recursive": "true" if recursive else "false"},
        )
        return resp.then(no_answer)
