"""Images out of a local Docker Engine: ``docker save``'s archive fetched over the
engine's unix socket (``GET /images/{name}/get``), streamed to a file within a cap.

Only a unix socket is spoken to: the engine runs as root on this host, and a
``tcp://`` engine would hand forkd an image over a connection nobody authenticated.
What the archive holds is not read here (it is as hostile as any image); the
docker-archive reader checks it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

import httpx

from forkd.errors import Invalid, NotFound, Unavailable, UpstreamError
from forkd.oci.reference import DIGEST

DEFAULT_SOCKET = Path("/var/run/docker.sock")
MAX_ARCHIVE_BYTES = 64 << 30  # one saved image; the daemon's disk is the real bound
CONNECT_TIMEOUT_SECS = 10.0
READ_TIMEOUT_SECS = 600.0  # the engine may think a long time before the first byte of a big image
CHUNK_BYTES = 1 << 20
ERROR_BODY_BYTES = 4096  # of an engine's error answer, read to quote its message
MAX_NAME_LENGTH = 255  # the distribution grammar's cap on a repository name
MAX_REFERENCE_LENGTH = 512  # a name with its tag and digest
MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path less its terminating NUL

# Docker's reference grammar (distribution/reference): [domain/]path[:tag][@digest].
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(
    rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:.]+\])(?::[0-9]{{1,5}})?"
)
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}")
_IMAGE_ID = re.compile(r"sha256:[a-f0-9]{64}")

ProgressFn = Callable[[int], None]


def check_image_name(name: str, *, allow_digest: bool = True) -> str:
    """``name`` when it is a Docker image reference (``[domain/]path[:tag][@digest]``)
    or image id (``sha256:<hex>``); :class:`Invalid` saying what is wrong otherwise.

    ``allow_digest=False`` is for names an image is tagged with (``docker build -t``)."""
    if not isinstance(name, str) or not name:
        raise Invalid("image name must not be empty")
    if len(name) > MAX_REFERENCE_LENGTH:
        raise Invalid(f"image name is longer than {MAX_REFERENCE_LENGTH} characters")
    if any(c.isspace() or not c.isprintable() for c in name):
        raise Invalid(f"invalid image name {name!r}: no spaces or control characters")
    if _IMAGE_ID.fullmatch(name):
        if not allow_digest:
            raise Invalid(f"invalid image name {name!r}: an image id cannot be a tag")
        return name
    rest, digest = name, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not allow_digest:
            raise Invalid(f"invalid image name {name!r}: a tag cannot carry a digest")
        if not _DIGEST.fullmatch(digest):
            raise Invalid(f"invalid image name {name!r}: malformed digest {digest!r}")
    repository, tag = rest, None
    slash, colon = rest.rfind("/"), rest.rfind(":")
    if colon > slash:  # a colon after the last slash starts a tag (one before is a port)
        repository, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise Invalid(
                f"invalid image name {name!r}: a tag is 1-128 of letters, digits, '_', '.', '-'"
            )
    _check_repository(name, repository)
    return name


def _check_repository(name: str, repository: str) -> None:
    if not repository or len(repository) > MAX_NAME_LENGTH:
        raise Invalid(
            f"invalid image name {name!r}: repository must be 1-{MAX_NAME_LENGTH} characters"
        )
    parts = repository.split("/")
    first = parts[0]
    # As Docker splits: the first part is a registry when it has a dot or a port, or is localhost.
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost"):
        if not _DOMAIN.fullmatch(first):
            raise Invalid(f"invalid image name {name!r}: malformed registry {first!r}")
        parts = parts[1:]
    for part in parts:
        if not _PATH_COMPONENT.fullmatch(part):
            raise Invalid(
                f"invalid image name {name!r}: {part!r} is not a repository component "
                "(lower-case letters and digits, separated by '.', '_', '__' or '-')"
            )


def socket_path(docker_host: str | None = None) -> Path:
    """The unix socket of the engine ``docker_host`` names (a ``unix://`` URL or a path);
    by default ``$DOCKER_HOST``, else ``/var/run/docker.sock``."""
    host = docker_host if docker_host is not None else os.environ.get("DOCKER_HOST") or ""
    origin = "docker_host" if docker_host is not None else "DOCKER_HOST"
    if not host:
        return DEFAULT_SOCKET
    if any(c.isspace() or not c.isprintable() for c in host) or "\0" in host:
        raise Invalid(f"{origin} {host!r} has spaces or control characters")
    if host.startswith("unix://"):
        path = host[len("unix://") :]
    elif "://" in host:
        scheme = host.split("://", 1)[0]
        raise Invalid(
            f"{origin} {host!r}: forkd reaches a Docker Engine only through its unix socket "
            f"(unix:///path), not {scheme}://: an image fetched over the network from an engine "
            "would travel unauthenticated and unchecked by the engine's own socket permissions"
        )
    else:
        path = host
    if not path.startswith("/"):
        raise Invalid(f"{origin} {host!r}: the socket must be an absolute path (unix:///path)")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise Invalid(f"{origin} {host!r}: a unix socket path is at most {MAX_SOCKET_PATH} bytes")
    return Path(path)


def save(
    image: str,
    out: Path,
    *,
    docker_host: str | None = None,
    max_bytes: int = MAX_ARCHIVE_BYTES,
    progress: ProgressFn | None = None,
) -> None:
    """Write ``docker save IMAGE``'s archive to ``out``, from the engine at ``docker_host``.

    The archive is staged beside ``out`` and renamed into place whole: on any failure
    nothing is left. ``progress`` is called with the bytes written so far.
    Raises :class:`NotFound` (no such image), :class:`Unavailable` (no engine on that
    socket, or no permission to use it), :class:`Invalid` (a malformed name or host, or
    an archive over ``max_bytes``), :class:`UpstreamError` (the engine failed)."""
    check_image_name(image)
    sock = socket_path(docker_host)
    if max_bytes <= 0:
        raise Invalid(f"max_bytes must be positive, not {max_bytes}")
    out = Path(out)
    if not out.parent.is_dir():
        raise Invalid(f"cannot save {image} to {out}: {out.parent} is not a directory")
    _check_socket(sock)
    fd, staged_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    staged = Path(staged_name)
    try:
        with os.fdopen(fd, "wb") as sink, _engine(sock) as client:
            _stream(client, sock, image, sink, max_bytes, progress)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(staged, out)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


MAX_INSPECT_BYTES = 1 << 20


def image_id(image: str, *, docker_host: str | None = None) -> str:
    """The engine's id of ``image`` (its config's digest, ``sha256:<hex>``): what an
    import asks first, to find an image it imported before without exporting it."""
    check_image_name(image)
    sock = socket_path(docker_host)
    _check_socket(sock)
    found = None
    with (
        _engine(sock) as client,
        client.stream("GET", f"/images/{quote(image, safe='/:@')}/json") as answer,
    ):
        if answer.status_code != 200:
            raise _answer_error(sock, image, answer)
        body = b""
        for chunk in answer.iter_raw(CHUNK_BYTES):
            body += chunk
            if len(body) > MAX_INSPECT_BYTES:  # an engine's inspect is a few KiB
                break
        with contextlib.suppress(ValueError, AttributeError):
            found = json.loads(body).get("Id")
    if not isinstance(found, str) or not DIGEST.fullmatch(found):
        raise UpstreamError(f"the Docker Engine at unix://{sock} gave {image} no image id")
    return found


def _check_socket(sock: Path) -> None:
    """A clear word before connecting: missing, not a socket, or not ours to use."""
    try:
        mode = sock.stat().st_mode
    except FileNotFoundError:
        raise Unavailable(
            f"no Docker Engine at unix://{sock}: the socket does not exist (is dockerd running "
            "there? DOCKER_HOST names another socket)"
        ) from None
    except PermissionError:  # a directory on the way is closed to this user
        raise Unavailable(_permission_message(sock)) from None
    if not stat.S_ISSOCK(mode):
        raise Unavailable(f"unix://{sock} is not a socket: no Docker Engine listens there")
    if not os.access(sock, os.R_OK | os.W_OK):
        raise Unavailable(_permission_message(sock))


def _permission_message(sock: Path) -> str:
    return (
        f"permission denied on the Docker Engine socket unix://{sock}: run as a user in "
        "the socket's group (usually 'docker') or as root"
    )


@contextlib.contextmanager
def _engine(sock: Path) -> Iterator[httpx.Client]:
    transport = httpx.HTTPTransport(uds=str(sock))
    timeout = httpx.Timeout(READ_TIMEOUT_SECS, connect=CONNECT_TIMEOUT_SECS)
    # The host part is never resolved: every request goes to the socket.
    with httpx.Client(transport=transport, base_url="http://docker", timeout=timeout) as client:
        try:
            yield client
        except httpx.TransportError as exc:
            raise _transport_error(sock, exc) from exc


def _stream(
    client: httpx.Client,
    sock: Path,
    image: str,
    sink: BinaryIO,
    max_bytes: int,
    progress: ProgressFn | None,
) -> None:
    url = f"/images/{quote(image, safe='/:@')}/get"
    with client.stream("GET", url) as answer:
        if answer.status_code != 200:
            raise _answer_error(sock, image, answer)
        written = 0
        for chunk in answer.iter_raw(CHUNK_BYTES):
            written += len(chunk)
            if written > max_bytes:
                raise Invalid(f"image {image} is larger than the cap of {max_bytes} bytes")
            sink.write(chunk)
            if progress is not None:
                progress(written)
        if written == 0:
            raise UpstreamError(
                f"the Docker Engine at unix://{sock} sent an empty archive for {image}"
            )


def _answer_error(sock: Path, image: str, answer: httpx.Response) -> Exception:
    message = _engine_message(answer)
    if answer.status_code == 404:
        return NotFound(f"no image {image} in the Docker Engine at unix://{sock}")
    if answer.status_code == 400:
        return Invalid(f"the Docker Engine refused the image name {image}: {message}")
    return UpstreamError(
        f"the Docker Engine at unix://{sock} failed to export {image} "
        f"(HTTP {answer.status_code}): {message}"
    )


def _engine_message(answer: httpx.Response) -> str:
    """The engine's ``{"message": ...}``, or the start of its answer, cut and printable."""
    body = b""
    for chunk in answer.iter_raw(ERROR_BODY_BYTES):
        body += chunk
        if len(body) >= ERROR_BODY_BYTES:
            break
    text = body[:ERROR_BODY_BYTES].decode(errors="replace")
    match = re.search(r'"message"\s*:\s*"((?:[^"\\]|\\.)*)"', text)
    if match:
        text = match.group(1)
    return "".join(c if c.isprintable() else " " for c in text).strip()[:500] or "no message"


def _transport_error(sock: Path, exc: httpx.TransportError) -> Exception:
    code = _errno(exc)
    if code in (errno.EACCES, errno.EPERM):
        return Unavailable(_permission_message(sock))
    if code == errno.ENOENT:
        return Unavailable(f"no Docker Engine at unix://{sock}: the socket does not exist")
    if code == errno.ECONNREFUSED:
        return Unavailable(
            f"the Docker Engine at unix://{sock} is not running (connection refused)"
        )
    if isinstance(exc, httpx.TimeoutException):
        return Unavailable(f"the Docker Engine at unix://{sock} did not answer in time")
    if isinstance(exc, httpx.ConnectError):
        return Unavailable(f"cannot reach the Docker Engine at unix://{sock}: {exc}")
    return UpstreamError(f"the Docker Engine at unix://{sock} broke off the export: {exc}")


def _errno(exc: BaseException) -> int | None:
    """The OS error under httpx's and httpcore's wrappers, if one caused ``exc``."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None
