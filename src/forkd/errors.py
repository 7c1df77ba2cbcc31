"""Exception types shared by the VM driver, the image builder and the daemon."""


class ForkdError(Exception):
    """Base class of every error forkd raises on purpose."""


class HostToolMissing(ForkdError):
    """A program forkd needs on the host is not installed."""

    def __init__(self, tool: str, package: str) -> None:
        super().__init__(
            f"{tool} not found on this host: install the Debian package {package!r} "
            f"(apt-get install --no-install-recommends {package})"
        )
        self.tool = tool
        self.package = package


class ImageError(ForkdError):
    """Building or finding a guest image failed."""


class VMError(ForkdError):
    """A VM could not be started, controlled or snapshotted."""


class SnapshotError(VMError):
    """A snapshot could not be written, or is unusable for a restore."""


class AgentError(ForkdError):
    """The guest agent could not be reached or answered with an error.

    ``kind`` is the guest-side exception class name when the agent answered
    (``FileNotFoundError``, ``ValueError``, ...), else ``None``.
    """

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
