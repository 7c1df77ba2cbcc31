"""The OCI distribution API, the part forkd needs: blobs and manifests of one repository.

Plain HTTP only to a registry the operator listed, and a registry on this host
only when listed (:mod:`forkd.oci.policy`, enforced on every connection by
:mod:`forkd.oci.connect`); every other registry is spoken to over HTTPS, its
certificate checked. A registry may be hostile, so:

- every answer is read raw (``Accept-Encoding: identity``; a body the server
  compressed anyway is never inflated: its digest then fails) and bounded
  before it is read: manifests, blobs of a known size, error bodies;
- a blob must arrive, or be taken, within a deadline that grows with its size
  (no registry holds a transfer open by trickling bytes either way);
- an upload goes only to the registry's own origin (its ``Location`` may not
  send credentials elsewhere), and a redirect (blob storage) is followed
  without credentials and never from HTTPS down to HTTP;
- every blob is checked against its digest before it is used.

Errors are forkd's: a missing manifest is :class:`~forkd.errors.NotFound`,
credentials refused are :class:`~forkd.errors.UpstreamRefused` (403), and a
registry that cannot be reached or answers wrongly is
:class:`~forkd.errors.UpstreamError` (502). Each names the registry and says
what it answered by its status alone (and an error code of the OCI spec's
list): nothing of a body, a header or a connection error goes back to the
client, whose reference may name any service. The daemon log has the details.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterable, Iterator
from http import HTTPStatus
from types import TracebackType
from typing import Any

import httpx

from forkd import import_deadline
from forkd.errors import NotFound, UpstreamError, UpstreamRefused
from forkd.oci import auth
from forkd.oci.connect import CheckedTransport, transfer_deadline
from forkd.oci.policy import RegistryPolicy
from forkd.oci.reference import Reference

log = logging.getLogger(__name__)
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
MANIFEST_BYTES_LIMIT = 4 << 20
SMALL_BODY_LIMIT = 64 << 10  # what is read of an error or an upload's answer
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
BLOB_DEADLINE_SECS = 60.0  # plus a second per MiB (1 MiB/s at least), either way
UPLOAD_PIECE_BYTES = 256 << 10  # an upload is written in pieces this big, its deadline checked
MAX_REDIRECTS = 3
# What a container image's manifest may be, for an image import (forkd's own snapshots
# are OCI image manifests of an artifact type: get_manifest).
IMAGE_MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
# The error codes of the OCI distribution spec: the only words of a registry's that
# go back to the client (anything else in an error body may be any service's text).
OCI_ERROR_CODES = frozenset(
    {
        "BLOB_UNKNOWN",
        "BLOB_UPLOAD_INVALID",
        "BLOB_UPLOAD_UNKNOWN",
        "DIGEST_INVALID",
        "MANIFEST_BLOB_UNKNOWN",
        "MANIFEST_INVALID",
        "MANIFEST_UNKNOWN",
        "NAME_INVALID",
        "NAME_UNKNOWN",
        "SIZE_INVALID",
        "UNAUTHORIZED",
        "DENIED",
        "UNSUPPORTED",
        "TOOMANYREQUESTS",
    }
)
# Manifest types a reference may name by mistake, by the name a user knows them.
OTHER_MANIFESTS = {
    "application/vnd.oci.image.index.v1+json": "an OCI image index",
    "application/vnd.docker.distribution.manifest.v2+json": "a Docker image",
    "application/vnd.docker.distribution.manifest.list.v2+json": "a Docker image list",
}


def sha256(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Registry:
    """One repository of one registry. Not thread-safe: one per thread, or a lock."""

    def __init__(
        self,
        ref: Reference,
        *,
        policy: RegistryPolicy | None = None,
        credentials: auth.Credentials | None = None,
        transport: httpx.BaseTransport | None = None,  # tests: a fake registry
    ) -> None:
        """:class:`~forkd.errors.Invalid` when ``policy`` (default: HTTPS only, nothing
        on this host) refuses the registry; nothing is contacted before a request."""
        self.ref = ref
        policy = policy or RegistryPolicy()
        self.scheme = policy.scheme(ref)
        plain = self.scheme == "http"
        self.base = f"{self.scheme}://{ref.registry}/v2/{ref.repository}"
        self.origin = httpx.URL(self.base).copy_with(path="/", query=None)
        common: dict[str, Any] = {
            "timeout": TIMEOUT,
            "follow_redirects": False,  # followed by hand: see get_blob
            "headers": {"User-Agent": "forkd", "Accept-Encoding": "identity"},
        }
        self._client = httpx.Client(
            auth=auth.RegistryAuth(credentials, plain_http_realm=plain),
            transport=transport or CheckedTransport(policy, ref.registry),
            **common,
        )
        # For redirects to blob storage.
        self._anonymous = httpx.Client(
            transport=transport or CheckedTransport(policy, ref.registry), **common
        )

    def close(self) -> None:
        self._client.close()
        self._anonymous.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------ blobs

    def has_blob(self, digest: str) -> bool:
        r = self._send("HEAD", f"{self.base}/blobs/{digest}")
        if r.status_code == 404:
            return False
        self._check(r, f"blob {digest}")
        return True

    def put_blob(self, data: bytes, digest: str) -> None:
        """Upload ``data`` as ``digest`` (a monolithic upload: a session, then one PUT)."""
        r = self._send("POST", f"{self.base}/blobs/uploads/")
        self._check(r, "blob upload", (202,))
        location = r.headers.get("Location")
        if not location:
            raise UpstreamError(f"registry {self.ref.registry} gave an upload no Location")
        try:
            url = httpx.URL(self.base).join(location)
        except httpx.InvalidURL as exc:
            raise UpstreamError(
                f"registry {self.ref.registry} gave an upload a bad Location"
            ) from exc
        if (url.scheme, url.host, url.port) != (
            self.origin.scheme,
            self.origin.host,
            self.origin.port,
        ):
            raise UpstreamError(
                f"registry {self.ref.registry} sent the upload to another origin: refused, "
                "credentials go only to the registry itself"
            )
        # The whole upload has a deadline, like a download's: a registry that takes
        # the bytes slowly enough never to trip a per-write timeout would otherwise
        # hold a transfer slot for as long as it likes.
        deadline = time.monotonic() + BLOB_DEADLINE_SECS + len(data) / (1 << 20)
        r = self._send(
            "PUT",
            url.copy_merge_params({"digest": digest}),
            content=_paced(data, deadline, f"blob {digest}"),
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Length": str(len(data)),
            },
            deadline=deadline,
        )
        self._check(r, f"blob {digest}", (201, 204))

    def get_blob(self, digest: str, size: int) -> bytes:
        """The blob ``digest`` of ``size`` bytes (the manifest's word), checked against both."""
        deadline = time.monotonic() + BLOB_DEADLINE_SECS + size / (1 << 20)
        with self._open_blob(digest, deadline) as r:
            data = _read_at_most(r, size, f"blob {digest}", deadline)
        if len(data) != size or sha256(data) != digest:
            raise UpstreamError(
                f"registry {self.ref.registry} sent blob {digest} with the wrong content: "
                "refusing it"
            )
        return data

    @contextlib.contextmanager
    def blob_chunks(self, digest: str, size: int) -> Iterator[Iterator[bytes]]:
        """The blob ``digest`` of ``size`` bytes, piece by piece as it arrives (a layer may
        be GiBs); checked against both at its end, so a caller that keeps what it was
        given only once the pieces are all read keeps nothing wrong."""
        deadline = time.monotonic() + BLOB_DEADLINE_SECS + size / (1 << 20)
        what = f"blob {digest}"
        with self._open_blob(digest, deadline) as r:
            yield self._checked_pieces(r, digest, size, deadline, what)

    def _checked_pieces(
        self, r: httpx.Response, digest: str, size: int, deadline: float, what: str
    ) -> Iterator[bytes]:
        h, got = hashlib.sha256(), 0
        with _reading(what):
            for piece in r.iter_raw():  # as each read gives it: the deadline is checked
                got += len(piece)
                if got > size:
                    raise UpstreamError(f"the registry sent more than {size} bytes for {what}")
                if time.monotonic() > deadline:
                    raise UpstreamError(f"the registry was too slow sending {what}")
                h.update(piece)
                yield piece
        if got != size or "sha256:" + h.hexdigest() != digest:
            raise UpstreamError(
                f"registry {self.ref.registry} sent blob {digest} with the wrong content: "
                "refusing it"
            )

    @contextlib.contextmanager
    def _open_blob(self, digest: str, deadline: float) -> Iterator[httpx.Response]:
        """The answer to a blob GET, past the redirects to blob storage, its status 200."""
        url = httpx.URL(f"{self.base}/blobs/{digest}")
        client = self._client
        for _ in range(MAX_REDIRECTS + 1):
            with self._stream(client, "GET", url, deadline) as r:
                if r.status_code in (301, 302, 303, 307, 308) and r.headers.get("Location"):
                    try:
                        nxt = url.join(r.headers["Location"])
                    except httpx.InvalidURL as exc:
                        raise UpstreamError(
                            f"registry {self.ref.registry} redirected blob {digest} nowhere"
                        ) from exc
                    if url.scheme == "https" and nxt.scheme != "https":
                        raise UpstreamError(
                            f"registry {self.ref.registry} redirected blob {digest} "
                            "from HTTPS to another scheme: refused"
                        )
                    url, client = nxt, self._anonymous  # no credentials past a redirect
                    continue
                self._check(r, f"blob {digest}")
                yield r
                return
        raise UpstreamError(f"registry {self.ref.registry} redirected blob {digest} too often")

    # ------------------------------------------------------------ manifests

    def put_manifest(self, body: bytes, reference: str) -> str:
        """Store a manifest under ``reference`` (a tag or its digest); returns its digest."""
        r = self._send(
            "PUT",
            f"{self.base}/manifests/{reference}",
            content=body,
            headers={"Content-Type": MANIFEST_TYPE},
        )
        self._check(r, f"manifest {reference}", (201, 200))
        return sha256(body)

    def has_manifest(self, reference: str) -> bool:
        r = self._send(
            "HEAD", f"{self.base}/manifests/{reference}", headers={"Accept": MANIFEST_TYPE}
        )
        if r.status_code == 404:
            return False
        self._check(r, f"manifest {reference}")
        return True

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        """A manifest's bytes and digest; by digest, the bytes are checked against it."""
        deadline = time.monotonic() + BLOB_DEADLINE_SECS
        url = f"{self.base}/manifests/{reference}"
        accept = {"Accept": MANIFEST_TYPE}
        with self._stream(self._client, "GET", url, deadline, headers=accept) as r:
            if r.status_code == 404:
                raise NotFound(f"{self._where(reference)} does not exist in the registry")
            self._check(r, f"manifest {reference}")
            body = _read_at_most(r, MANIFEST_BYTES_LIMIT, f"manifest {reference}", deadline)
            kind = r.headers.get("Content-Type", "").split(";")[0].strip()
        digest = sha256(body)
        if reference.startswith("sha256:") and digest != reference:
            raise UpstreamError(f"registry {self.ref.registry} sent a manifest not {reference}")
        if kind and kind != MANIFEST_TYPE:
            what = OTHER_MANIFESTS.get(kind, "of another media type")
            raise UpstreamError(f"{self._where(reference)} is {what}, not a forkd snapshot")
        return body, digest

    def get_image_manifest(self, reference: str) -> tuple[bytes, str, str]:
        """A container image's manifest or index (OCI or Docker): its bytes, digest and
        the media type the registry served it as ("" if none); by digest, the bytes are
        checked against it. What the body holds is the caller's to check."""
        deadline = time.monotonic() + BLOB_DEADLINE_SECS
        url = f"{self.base}/manifests/{reference}"
        accept = ", ".join(IMAGE_MANIFEST_TYPES)
        with self._stream(self._client, "GET", url, deadline, headers={"Accept": accept}) as r:
            if r.status_code == 404:
                raise NotFound(f"{self._where(reference)} does not exist in the registry")
            self._check(r, f"manifest {reference}")
            declared = r.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > MANIFEST_BYTES_LIMIT:
                raise UpstreamError(
                    f"registry {self.ref.registry} offered a manifest of {declared} bytes for "
                    f"{reference}; at most {MANIFEST_BYTES_LIMIT} are read"
                )
            body = _read_at_most(r, MANIFEST_BYTES_LIMIT, f"manifest {reference}", deadline)
            kind = r.headers.get("Content-Type", "").split(";")[0].strip()
        digest = sha256(body)
        if reference.startswith("sha256:") and digest != reference:
            raise UpstreamError(f"registry {self.ref.registry} sent a manifest not {reference}")
        return body, digest, kind

    # ------------------------------------------------------------ plumbing

    def _where(self, reference: str) -> str:
        sep = "@" if reference.startswith("sha256:") else ":"
        return f"{self.ref.registry}/{self.ref.repository}{sep}{reference}"

    def _send(
        self, method: str, url: Any, deadline: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        """A request whose answer's body is read only up to :data:`SMALL_BODY_LIMIT`,
        by ``deadline`` (default: :data:`BLOB_DEADLINE_SECS` from now)."""
        if deadline is None:
            deadline = time.monotonic() + BLOB_DEADLINE_SECS
        with self._stream(self._client, method, url, deadline, **kwargs) as r:
            body = _read_at_most(r, SMALL_BODY_LIMIT, "an answer", deadline, cut=True)
            return httpx.Response(r.status_code, headers=r.headers, content=body, request=r.request)

    def _stream(
        self, client: httpx.Client, method: str, url: Any, deadline: float, **kwargs: Any
    ) -> _Stream:
        """A request whose every read and write on the wire ends by ``deadline``."""
        return _Stream(client.stream(method, url, **kwargs), self, deadline)

    def _unreachable(self, exc: Exception) -> UpstreamError:
        # Refused, timed out, no such name, a certificate: all one to the client, who
        # may not map the network through a registry's name. The operator gets it.
        log.warning("registry %s unreachable over %s: %r", self.ref.registry, self.scheme, exc)
        return UpstreamError(f"registry {self.ref.registry} is unreachable over {self.scheme}")

    def _check(self, r: httpx.Response, doing: str, ok: tuple[int, ...] = (200,)) -> None:
        """Nothing when ``r`` has an ``ok`` status; else the error that says so: the status
        and ``doing`` (``manifest v1``), never the registry's own words."""
        if r.status_code in ok:
            return
        answered = (
            f"registry {self.ref.registry} answered {status_line(r.status_code)}"
            f"{_error_codes(r)} to {r.request.method} {doing} in {self.ref.repository}"
        )
        if r.status_code in (401, 403):
            raise UpstreamRefused(
                f"{answered}: credentials refused or missing; give a token, or credentials "
                f"in {auth.docker_config_path()}"
            )
        if r.status_code == 404:
            raise NotFound(answered)
        raise UpstreamError(answered)


class _Stream:
    """``client.stream()`` whose connection errors become :class:`UpstreamError`, held to
    a deadline on the wire (:func:`~forkd.oci.connect.transfer_deadline`) until it is
    closed."""

    def __init__(
        self,
        ctx: contextlib.AbstractContextManager[httpx.Response],
        registry: Registry,
        deadline: float,
    ) -> None:
        self._ctx, self._registry = ctx, registry
        self._bound = transfer_deadline(deadline)

    def __enter__(self) -> httpx.Response:
        self._bound.__enter__()
        try:
            return self._ctx.__enter__()
        except httpx.TimeoutException as exc:
            self._bound.__exit__(None, None, None)
            import_deadline.check()  # the import's whole time is up, not the registry's
            log.warning("registry %s: %r", self._registry.ref.registry, exc)
            raise UpstreamError(
                f"registry {self._registry.ref.registry} was too slow to answer"
            ) from exc
        except httpx.HTTPError as exc:
            self._bound.__exit__(None, None, None)
            raise self._registry._unreachable(exc) from exc
        except BaseException:
            self._bound.__exit__(None, None, None)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._ctx.__exit__(exc_type, exc, tb)
        finally:
            self._bound.__exit__(None, None, None)


def _paced(data: bytes, deadline: float, what: str) -> Iterator[bytes]:
    """``data`` in pieces for a request body; past ``deadline`` the upload stops."""
    view = memoryview(data)
    for start in range(0, len(view), UPLOAD_PIECE_BYTES):
        if time.monotonic() > deadline:
            raise UpstreamError(f"the registry was too slow taking {what}")
        yield bytes(view[start : start + UPLOAD_PIECE_BYTES])


def _read_at_most(
    r: httpx.Response, limit: int, what: str, deadline: float, cut: bool = False
) -> bytes:
    """The raw body, at most ``limit`` bytes (more is an error, or with ``cut`` dropped),
    all of it before ``deadline``."""
    buf = bytearray()
    pieces: Iterable[bytes]
    try:
        pieces = [r.content]  # read already: a transport that does not stream
    except httpx.ResponseNotRead:
        pieces = r.iter_raw()
    with _reading(what):
        for piece in pieces:
            buf += piece
            if len(buf) > limit:
                if cut:
                    return bytes(buf[:limit])
                raise UpstreamError(f"the registry sent more than {limit} bytes for {what}")
            if time.monotonic() > deadline:
                raise UpstreamError(f"the registry was too slow sending {what}")
    return bytes(buf)


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """An answer's body being read: a read past its deadline, or a connection that broke,
    is the registry's failing (502), or the import's when its whole time is up (504)."""
    try:
        yield
    except httpx.TimeoutException as exc:
        import_deadline.check()
        raise UpstreamError(f"the registry was too slow sending {what}") from exc
    except httpx.HTTPError as exc:
        log.warning("reading %s from a registry failed: %r", what, exc)
        raise UpstreamError(f"the registry stopped sending {what}") from exc


def status_line(status: int) -> str:
    """``404 Not Found``: the status and its standard phrase (never the server's own)."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


def _error_codes(r: httpx.Response) -> str:
    """`` (MANIFEST_UNKNOWN)``: the codes of the answer's OCI error body that the spec
    lists, at most three; "" for any other body."""
    try:
        body = r.content
    except httpx.ResponseNotRead:  # a streamed answer: only its start is read
        try:
            body = _read_at_most(r, SMALL_BODY_LIMIT, "an error", time.monotonic() + 10, True)
        except UpstreamError:
            return ""
    try:
        errors = json.loads(body).get("errors")
        codes = [e.get("code") for e in errors[:3]] if isinstance(errors, list) else []
    except (ValueError, AttributeError, TypeError, RecursionError):
        return ""
    known = [c for c in dict.fromkeys(codes) if isinstance(c, str) and c in OCI_ERROR_CODES]
    return f" ({', '.join(known)})" if known else ""
