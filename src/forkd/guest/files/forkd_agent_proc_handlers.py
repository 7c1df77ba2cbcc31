"""The guest agent's handlers of the ``proc_*`` ops: programs that outlive their request
and the host connection, whose output waits in a ring per process.

forkd_procs.py runs the processes; here are the requests' parameters and the
answers. Imported from the agent's own directory. Standard library only.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import forkd_agent_command as command
import forkd_agent_params as params
import forkd_exec
import forkd_procs
from forkd_agent_params import RequestError
from forkd_files import EncodedJSON, WithRawBytes

from forkd import agent_wire as wire
from forkd.agent_wire import LISTED_CMD_CHARS, MAX_PROC_READ_BYTES, MAX_PROC_STDIN_BYTES

PROCESSES = forkd_procs.ProcessTable()
DEFAULT_PROC_READ_BYTES = 256 * 1024
# The thread answering a proc_read runs ahead of the processes whose output it
# carries: on a guest with one busy vCPU, fair shares would leave it a third.
PROC_READ_NICE = -10
MAX_PROC_WAIT_S = 30.0
MAX_PROC_LINGER_S = 1.0
MAX_PTY_SIDE = params.MAX_PTY_SIDE


def _process(req: dict[str, Any]) -> forkd_procs.BackgroundProcess:
    """The process named by the request's ``pid`` (ProcessLookupError if none)."""
    return PROCESSES.get(params.require(req, "pid", int, "an integer"))


def _proc_info(status: forkd_procs.ProcessStatus) -> wire.ProcInfo:
    exit_code = None
    if status.returncode is not None:
        if status.timed_out:
            exit_code = forkd_exec.EXIT_TIMEOUT
        else:
            exit_code = forkd_exec.exit_code(status.returncode)
    return {
        "pid": status.pid,
        "cmd": status.argv,
        "pty": status.pty,
        "stdin": status.stdin,
        "running": status.returncode is None,
        "exit_code": exit_code,
        "started_at": status.started_at,
        "ended_at": status.ended_at,
        "output_end": status.output_end,
        "output_start": status.output_start,
    }


def op_proc_start(req: dict[str, Any]) -> wire.ProcInfo:
    who = command.identity(req)
    spec = forkd_procs.ProcessSpec(
        argv=command.with_shell(params.proc_argv(req)),
        env=command.env(req, who.home),
        cwd=command.cwd(req),
        identity=who,
        stdin=params.flag(req, "stdin"),
        pty_size=params.pty_size(req),
        timeout_s=params.proc_timeout(req),
    )
    return _proc_info(PROCESSES.start(spec).status())


def listed_argv(argv: list[str], limit: int = LISTED_CMD_CHARS) -> list[str]:
    """``argv`` as a listing shows it: at most ``limit`` characters in all, the cut
    element ending in an ellipsis (as ``ps`` cuts a long command line); the process's
    own ``proc_info`` has all of it."""
    shown: list[str] = []
    left = limit
    for arg in argv:
        if len(arg) > left:
            shown.append(arg[: max(left - 1, 0)] + "\u2026")
            break
        shown.append(arg)
        left -= len(arg)
    return shown


def op_proc_list(req: dict[str, Any]) -> wire.ProcListAnswer:
    listed = []
    for proc in PROCESSES.list():
        info = _proc_info(proc.status())
        info["cmd"] = listed_argv(info["cmd"])
        listed.append(info)
    return {"processes": listed}


def op_proc_info(req: dict[str, Any]) -> wire.ProcInfo:
    return _proc_info(_process(req).status())


_STREAM_BYTES = {"stdout": b"stdout", "stderr": b"stderr", "pty": b"pty"}


def _runs(pieces: list[forkd_procs.OutputPiece]) -> list[list[forkd_procs.OutputPiece]]:
    """``pieces`` in runs of one stream (each piece starts where the one before ended)."""
    runs: list[list[forkd_procs.OutputPiece]] = []
    for piece in pieces:
        if runs and runs[-1][-1].stream == piece.stream:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return runs


def op_proc_read(req: dict[str, Any]) -> EncodedJSON:
    offset = params.int_param(req, "offset", 0, None)
    wait_s = params.seconds_param(req, "wait_s", 0.0, MAX_PROC_WAIT_S)
    max_bytes = params.int_param(req, "max_bytes", 1, MAX_PROC_READ_BYTES, DEFAULT_PROC_READ_BYTES)
    min_bytes = params.int_param(req, "min_bytes", 1, MAX_PROC_READ_BYTES, 1)
    linger_s = params.seconds_param(req, "linger_s", 0.0, MAX_PROC_LINGER_S)
    raw = params.flag(req, "raw")
    proc = _process(req)
    with contextlib.suppress(OSError):  # this thread only; it ends with its answer
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PROC_READ_NICE)
    with params.request_errors():
        output = proc.read(offset, max_bytes, wait_s, min(min_bytes, max_bytes), linger_s)
    return _encode_output(output, raw)


def _encode_output(output: forkd_procs.OutputSlice, raw: bool) -> EncodedJSON:
    """A proc_read's answer, built by hand: json.dumps would walk every character of the
    base64 again, which costs more than the base64 itself on a slow (TCG) guest. With
    ``raw``, the bytes follow the answer's line as they are, and chunks give their size:
    one chunk for each run of one stream's pieces (the ring keeps each read apart)."""
    info = _proc_info(output.status)
    parts = [b'{"chunks":[']
    for i, run in enumerate(_runs(output.pieces)):
        parts += [
            b"," if i else b"",
            b'{"stream":"%s","offset":%d' % (_STREAM_BYTES[run[0].stream], run[0].offset),
        ]
        if raw:
            parts.append(b',"size":%d}' % sum(len(piece.data) for piece in run))
        else:
            data = b"".join(piece.data for piece in run)
            parts += [b',"data":"', base64.b64encode(data), b'"}']
    rest = {
        "next_offset": output.next_offset,
        "gap": None if output.gap is None else {"from": output.gap[0], "to": output.gap[1]},
        "running": info["running"],
        "exit_code": info["exit_code"],
        "eof": output.complete,
    }
    parts += [b"],", json.dumps(rest, separators=(",", ":")).encode("ascii")[1:]]
    if raw:
        return WithRawBytes(parts, [piece.data for piece in output.pieces])
    return EncodedJSON(parts)


def op_proc_stdin(req: dict[str, Any]) -> wire.ProcStdinAnswer:
    data = params.base64_bytes(req, "data")
    if len(data) > MAX_PROC_STDIN_BYTES:
        raise RequestError(f"'data' is larger than {MAX_PROC_STDIN_BYTES} bytes")
    eof = params.flag(req, "eof")
    proc = _process(req)
    with params.request_errors():
        return {"written": proc.write_stdin(data, eof)}


def op_proc_signal(req: dict[str, Any]) -> wire.Empty:
    signum = params.signal_number(req)
    _process(req).send_signal(signum)
    return {}


def op_proc_resize(req: dict[str, Any]) -> wire.Empty:
    cols = params.int_param(req, "cols", 1, MAX_PTY_SIDE)
    rows = params.int_param(req, "rows", 1, MAX_PTY_SIDE)
    proc = _process(req)
    with params.request_errors():
        proc.resize(cols, rows)
    return {}


OPS: dict[str, Callable[[dict[str, Any]], Mapping[str, object] | EncodedJSON]] = {
    "proc_start": op_proc_start,
    "proc_list": op_proc_list,
    "proc_info": op_proc_info,
    "proc_read": op_proc_read,
    "proc_stdin": op_proc_stdin,
    "proc_signal": op_proc_signal,
    "proc_resize": op_proc_resize,
}
