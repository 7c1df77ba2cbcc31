"""forkd: sandboxes in QEMU microVMs that fork copy-on-write and branch at any depth.

This top-level package stays import-light: the SDK must not pull in the
daemon's dependencies (QEMU driver, FastAPI, ...).
"""

__version__ = "0.1.0"

_SDK = (
    "AsyncController",
    "AsyncSandbox",
    "AsyncSnapshot",
    "Controller",
    "ControllerError",
    "Sandbox",
    "Snapshot",
)
__all__ = [*_SDK, "__version__"]


def __getattr__(name: str) -> object:
    # The SDK is imported on first use, so ``import forkd`` stays cheap.
    if name in _SDK:
        from forkd import client

        return getattr(client, name)
    raise AttributeError(f"module 'forkd' has no attribute {name!r}")
