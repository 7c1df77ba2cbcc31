"""Every error forkd raises on purpose, in one tree.

Services raise these and nothing else; the HTTP layer maps each branch of
the tree to one status (``forkd.controller.http_errors``), never by reading
the message::

    ForkdError                 anything else that failed (500)
    ├── Invalid                bad input: the request, a name, a size, a path (400)
    ├── Unauthorized           no credential, or not the one asked for (401)
    ├── Forbidden              the guest refused for lack of permission (403)
    ├── NotFound               unknown snapshot, sandbox, volume or guest path (404)
    ├── Conflict               exists already, in use, not running, not bootable (409)
    ├── Busy                   a concurrency cap is reached: retry shortly (503)
    ├── OverCapacity           would pass a capacity cap: sandboxes, guest memory, n (429)
    ├── Unavailable            this host lacks what the request needs (503)
    │   └── HostToolMissing    a program forkd runs on the host is not installed
    ├── GuestError             the guest agent did not answer, or failed (502)
    │   └── AgentError         raised by the agent channel; ``kind`` names the guest's exception
    ├── StorageFull            the host's disk filled up while writing (500)
    │   └── NoRoom             a client's data would take the host's disk under its
    │                          reserve (--disk-reserve): refused, nothing kept (507)
    ├── GuestStorageFull       the guest's disk filled up; nothing half-written was kept (507)
    ├── TimedOut               an image import ran past --import-timeout (504)
    ├── ImageError             building or reading a guest image failed (500)
    └── VMError                QEMU could not be started, controlled or snapshotted (500)
        └── SnapshotError      a snapshot could not be written, or cannot be restored
"""

from __future__ import annotations


class ForkdError(Exception):
    """Base class of every error forkd raises on purpose."""


class Invalid(ForkdError):
    """The caller asked for something malformed or out of bounds; nothing changed."""


class Unauthorized(ForkdError):
    """No credential, or not the one asked for (the daemon's own port answers its bearer
    check in the middleware; E2B's port raises this for its key and a sandbox's token)."""


class Forbidden(ForkdError):
    """The guest refused the request for lack of permission."""


class NotFound(ForkdError):
    """The named snapshot, sandbox, volume or guest path does not exist."""


class Conflict(ForkdError):
    """The request clashes with the current state: exists, in use, not running."""


class Busy(ForkdError):
    """A concurrency cap is reached; the same request may succeed shortly."""


class OverCapacity(ForkdError):
    """Admitting the request would pass one of the daemon's capacity caps; nothing started."""


class Unavailable(ForkdError):
    """This host cannot serve the request (a tool or a feature is missing)."""


class HostToolMissing(Unavailable):
    """A program forkd needs on the host is not installed."""

    def __init__(self, tool: str, package: str) -> None:
        super().__init__(
            f"{tool} not found on this host: install the Debian package {package!r} "
            f"(apt-get install --no-install-recommends {package})"
        )
        self.tool = tool
        self.package = package


class UpstreamError(ForkdError):
    """A registry (or another daemon) answered wrongly or not at all (502)."""


class UpstreamRefused(Forbidden):
    """A registry refused the credentials forkd had for it (403)."""


class GuestError(ForkdError):
    """The guest did not answer, or answered with a failure forkd did not expect."""


class AgentError(GuestError):
    """The guest agent could not be reached or answered with an error.

    ``kind`` is the guest-side exception class name when the agent answered
    (``FileNotFoundError``, ``ValueError``, ...), else ``None``.
    """

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class StorageFull(ForkdError):
    """The host's disk filled up; what was being written was removed."""


class NoRoom(StorageFull):
    """Data written for a client (an image, an archive, a volume, a pull) would leave the
    host's disk under its reserve: refused before or while it was written, and nothing
    of it was kept."""


class TimedOut(ForkdError):
    """Work with a deadline of its own (an image import) ran past it; it was stopped."""


class GuestStorageFull(ForkdError):
    """The guest's disk (or quota) filled up while writing; what was written was removed."""


class ImageError(ForkdError):
    """Building or finding a guest image failed."""


class VMError(ForkdError):
    """A VM could not be started, controlled or snapshotted."""


class SnapshotError(VMError):
    """A snapshot could not be written, or is unusable for a restore."""
