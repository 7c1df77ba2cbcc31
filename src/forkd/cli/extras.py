"""Whether ``pip install 'forkd[server]'`` is there, for the verbs that need it.

``pip install forkd`` is the SDK and the client CLI; ``serve``, ``gateway``, ``image``
and ``doctor`` run the daemon or work on this host's VMs and images, and need the
server extra (FastAPI, uvicorn, qemu.qmp, pyroute2, ...). Without it they say
so in one line instead of a traceback.
"""

from __future__ import annotations

import importlib.util
import sys

import typer

# One module of each distribution the server extra adds (pyproject.toml).
SERVER_MODULES = (
    "fastapi",
    "uvicorn",
    "qemu.qmp",
    "pydantic",
    "prometheus_client",
    "anyio",
    "pyroute2",
    "websockets",
    "zstandard",
)


def missing_server_modules() -> list[str]:
    missing = []
    for name in SERVER_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a dotted name whose parent is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def require_server(verb: str) -> None:
    """Exit 1 with one line when the server extra is missing."""
    if missing_server_modules():
        print(f"forkd {verb} needs the server extra: pip install 'forkd[server]'", file=sys.stderr)
        raise typer.Exit(1)
