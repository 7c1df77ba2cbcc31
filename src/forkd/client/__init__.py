"""Python SDK for the forkd daemon (``forkd serve``).

Only the standard library and ``httpx`` are imported here, so the SDK installs
and imports without the daemon's dependencies (QEMU driver, FastAPI, ...).

Example::

    from forkd.client import Sandbox, Snapshot

    snap = Snapshot.create("py", warmup="import json")   # boot, warm up, snapshot
    with Sandbox("py") as sb:                             # fork one child
        print(sb.commands.run("uname -r").stdout)
        server = sb.commands.run("python3 -m http.server", background=True)
        print(sb.eval("x = 41; x + 1").result)            # '42'
        sb.files.write("/tmp/hello.txt", "hi")
        branch = sb.branch()                              # pause, snapshot, resume
        print(branch.tag, branch.pause_ms, "ms")
        for child in branch.fork(3):                      # every child sees x == 41
            with child:
                print(child.eval("x").result)

The daemon's address comes from ``FORKD_URL`` (default ``http://127.0.0.1:8889``;
``unix:/path/to.sock`` for a unix socket) and its token from ``FORKD_TOKEN`` or
the file named by ``FORKD_TOKEN_FILE``. The lower-level :class:`Controller`
maps one method to each route of the HTTP API.
"""

from __future__ import annotations

# The ``X as X`` imports are not in __all__ but stay importable from here, as
# they were before the SDK was split into modules.
from forkd.client.async_controller import AsyncController
from forkd.client.async_sandbox import AsyncSandbox
from forkd.client.async_snapshot import AsyncSnapshot
from forkd.client.commands import CommandHandle, Commands
from forkd.client.connection import DEFAULT_URL
from forkd.client.connection import JSONDict as JSONDict
from forkd.client.connection import _import_httpx_light as _import_httpx_light
from forkd.client.connection import _read_token_file as _read_token_file
from forkd.client.connection import _resolve_token as _resolve_token
from forkd.client.controller import Controller
from forkd.client.controller import _tar_directory as _tar_directory
from forkd.client.errors import ControllerError
from forkd.client.explore import DiffResult, ExploreResult, FileChange, VariantResult
from forkd.client.files import Files
from forkd.client.guest_agent import GuestAgent
from forkd.client.results import CommandResult, EvalResult, OutputEvent
from forkd.client.results import exit_code_of as exit_code_of
from forkd.client.sandbox import Sandbox
from forkd.client.snapshot import Snapshot

__all__ = [
    "DEFAULT_URL",
    "AsyncController",
    "AsyncSandbox",
    "AsyncSnapshot",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "Controller",
    "ControllerError",
    "DiffResult",
    "EvalResult",
    "ExploreResult",
    "FileChange",
    "Files",
    "GuestAgent",
    "OutputEvent",
    "Sandbox",
    "Snapshot",
    "VariantResult",
]
