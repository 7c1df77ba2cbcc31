"""forkd: sandboxes in QEMU microVMs that fork copy-on-write and branch at any depth.

This top-level package stays import-light: the SDK must not pull in the
daemon's dependencies (QEMU driver, FastAPI, ...).
"""

__version__ = "0.1.0"
