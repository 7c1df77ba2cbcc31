"""forkd: sandboxes in QEMU microVMs that fork copy-on-write and branch at any depth.

This top-level package stays import-light: the SDK must not pull in the
daemon's dependencies (QEMU driver, FastAPI, ...).
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # what a type checker sees; at run time they load on first use
    from forkd.client import (
        AsyncController,
        AsyncSandbox,
        AsyncSnapshot,
        Controller,
        ControllerError,
        Sandbox,
        Snapshot,
    )

__all__ = [
    "AsyncController",
    "AsyncSandbox",
    "AsyncSnapshot",
    "Controller",
    "ControllerError",
    "Sandbox",
    "Snapshot",
    "__version__",
]
_SDK = frozenset(__all__) - {"__version__"}


def __getattr__(name: str) -> object:
    # The SDK is imported on first use, so ``import forkd`` stays cheap.
    if name in _SDK:
        from forkd import client

        return getattr(client, name)
    raise AttributeError(f"module 'forkd' has no attribute {name!r}")
