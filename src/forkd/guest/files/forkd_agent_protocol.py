"""The guest agent's channel protocol: a request line in, its op's handler run, one
answer line out (see forkd-agent.py's docstring and docs/guest-agent.md).

Bytes on the wire are forkd_agent_transport.py's business; what an op does is
its handler's. Imported from the agent's own directory. Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import forkd_agent_handlers
import forkd_agent_proc_handlers
import forkd_entries
import forkd_files
import forkd_fsdiff
import forkd_stats
import forkd_watch
from forkd_agent_log import log
from forkd_agent_params import RequestError
from forkd_files import EncodedJSON, WithRawBytes

from forkd import agent_wire as wire

Handler = Callable[[dict[str, Any]], Mapping[str, object] | EncodedJSON]

OPS: dict[str, Handler] = {
    **forkd_agent_handlers.OPS,
    **forkd_agent_proc_handlers.OPS,
    **forkd_files.OPS,  # chunked uploads, ranged reads, tar streams
    **forkd_fsdiff.OPS,  # what the sandbox changed: its overlay's upper layer
    **forkd_stats.OPS,  # what it uses: CPU, memory, disk, network, processes
    **forkd_entries.OPS,  # an entry as E2B's envd describes one: stat, list, mkdir, move
    **forkd_watch.OPS,  # change notifications: the guest kernel's inotify
}

# Quick ops answered on the reader thread itself. For ``restore`` this also
# means no request read after it can run before the clock and RNGs are fixed.
INLINE_OPS = frozenset({"ping", "restore"})

# The most raw bytes an answer announces (a proc_read's or a file read's): what a
# restarted agent sends to end an answer its predecessor was cut off in.
MAX_RAW_BYTES = max(wire.MAX_PROC_READ_BYTES, wire.MAX_CHUNK_BYTES)


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode("ascii") + b"\n"


def error_message(req_id: int, exc: BaseException) -> dict[str, Any]:
    kind = type(exc).__name__
    if isinstance(exc, RequestError):
        kind = "ValueError"
    return {"id": req_id, "ok": False, "error": str(exc) or kind, "kind": kind}


def handle_request(req_id: int, req: dict[str, Any]) -> bytes:
    """Run one request; always returns an encoded answer line."""
    try:
        op = req.get("op")
        handler = OPS.get(op) if isinstance(op, str) else None
        if handler is None:
            raise RequestError(f"unknown op: {op!r}")
        result = handler(req)
        if isinstance(result, WithRawBytes):
            head = b'{"id":%d,"raw":%d,"ok":true,"result":' % (req_id, sum(map(len, result.raw)))
            return b"".join([head, *result, b"}\n", *result.raw])
        if isinstance(result, EncodedJSON):
            return b"".join([b'{"id":%d,"ok":true,"result":' % req_id, *result, b"}\n"])
        return encode({"id": req_id, "ok": True, "result": result})
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: still one answer
        if not isinstance(exc, OSError | RequestError):
            log(f"request {req_id} failed: {type(exc).__name__}: {exc}")
        return encode(error_message(req_id, exc))


def parse_request(line: bytes) -> tuple[int, dict[str, Any]] | None:
    """The request on ``line``, or None for lines the protocol says to ignore."""
    line = line.strip()
    if not line:
        return None
    try:
        req = json.loads(line)
    except ValueError:  # includes UnicodeDecodeError
        log(f"ignoring a line that is not JSON ({len(line)} bytes)")
        return None
    if not isinstance(req, dict):
        log("ignoring a JSON line that is not an object")
        return None
    req_id = req.get("id")
    if type(req_id) is not int:
        log("ignoring a request without an integer id")
        return None
    return req_id, req
