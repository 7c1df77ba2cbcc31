"""forkd guest agent: runs inside the VM and executes the host's requests.

Started by the guest's init as root (``python3 /opt/forkd/forkd-agent.py``) and
respawned if it dies. Standard library only.

Protocol (full reference: docs/guest-agent.md): newline-delimited JSON over a
byte stream, one UTF-8 object per line.

    host -> guest  {"id": 7, "op": "exec", "argv": ["ls", "/"]}
    guest -> host  {"id": 7, "ok": true, "result": {...}}
                   {"id": 7, "ok": false, "error": "message", "kind": "ValueError"}

Every request runs in its own thread, so many can be in flight; answers are
written in completion order, each as one whole line. Blank lines, lines that
are not JSON objects and requests without an integer id are ignored (a
snapshot may leave half a line behind; the host sends a lone newline first).

Background processes (ops ``proc_*``) outlive their request and the host
connection; forkd_procs.py, beside this file, runs them and keeps their output.

Transports: the virtio-serial port named "agent" (default), ``--device PATH``,
``--socket PATH`` (unix socket, for tests) or ``--stdio``.

Beside the virtio-serial channel, the agent serves the original forkd agent
protocol on TCP port 8888 (``--tcp``), which the host reaches at a sandbox's
guest_addr: one JSON request per connection (``ping``, ``exec``, ``eval``),
one JSON answer, then close.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import errno
import fcntl
import functools
import glob
import json
import math
import os
import queue
import re
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

# forkd_procs.py and forkd_files.py live beside the agent; the directory is on sys.path when the
# agent runs as a script, not when a test loads this file as a module.
_AGENT_DIR = os.path.dirname(os.path.abspath(__file__))
if _AGENT_DIR not in sys.path:
    sys.path.insert(0, _AGENT_DIR)
import forkd_eval  # noqa: E402
import forkd_eval_proc  # noqa: E402
import forkd_exec  # noqa: E402
import forkd_files  # noqa: E402
import forkd_identity  # noqa: E402
import forkd_procs  # noqa: E402

T = TypeVar("T")

AGENT_VERSION = "1"
PORT_NAME = "agent"  # name of the virtio-serial port (QEMU: virtserialport,name=agent)
VIRTIO_PORTS_DIR = "/sys/class/virtio-ports"

MAX_LINE_BYTES = 64 * 1024 * 1024  # longest request line accepted; longer ones are dropped
# exec keeps this many bytes of stdout and of stderr (the rest is read and dropped);
# eval keeps this many characters of stdout, of stderr and of the result repr.
MAX_OUTPUT_BYTES = forkd_exec.MAX_OUTPUT_BYTES
MAX_FILE_BYTES = 32 * 1024 * 1024  # file_read / file_write payload (base64 adds a third)
MAX_LIST_ENTRIES = 100_000  # file_list answers at most this many entries
READ_CHUNK_BYTES = 1024 * 1024

DEFAULT_EXEC_TIMEOUT_S = 30.0
MAX_EXEC_TIMEOUT_S = 86400.0  # as the HTTP API's (forkd.limits.MAX_EXEC_TIMEOUT_SECS)
DEVICE_REOPEN_DELAY_S = 0.02  # after EOF on the port (no host connected)
DEVICE_RETRY_S = 0.1  # port missing or cannot be opened
# Exists once an agent of this boot announced itself on the port (tmpfs: a boot
# starts without it, a fork keeps the running agent and its mark).
RESTART_MARK = "/run/forkd-agent.started"

# TCP: the original forkd agent protocol, one JSON request per connection
TCP_HOST = "0.0.0.0"
TCP_PORT = 8888
TCP_MAX_REQUEST_BYTES = 1024 * 1024  # longer requests get an error answer
TCP_READ_TIMEOUT_S = 5.0  # the whole request must arrive within this
TCP_WRITE_TIMEOUT_S = 30.0  # the client must take the whole answer within this
TCP_MAX_CONNECTIONS = 16  # served at once; more are closed at once
TCP_BACKLOG = 64
TCP_DRAIN_S = 0.5  # after answering: how long to read and drop what the client still sends
TCP_BIND_RETRY_S = 1.0

EXIT_TIMEOUT = forkd_exec.EXIT_TIMEOUT

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# A command's HOME, unless its environment (the image's or the request's) sets one,
# is its user's home directory from the image's /etc/passwd.
SHELL = "/bin/sh"
FALLBACK_SHELL = ("/opt/forkd/busybox", "sh")  # for an image without /bin/sh
# What the image (a container image's config) sets for every command that does
# not say otherwise: set by the host's ``configure`` op once, at the template's
# boot, and so held by every snapshot and fork of it.
IMAGE_DEFAULTS = forkd_identity.ImageDefaults()

# linux/random.h
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
MIN_ENTROPY_BYTES = 32
DRY_RESTORE_ENV = "FORKD_AGENT_DRY_RESTORE"  # "1": restore skips clock, kernel RNG, hostname


class RequestError(ValueError):
    """A malformed request (bad or missing parameter)."""


# --------------------------------------------------------------------------- logging


def log(message: str) -> None:
    """Write one line to stderr via the fd, so eval's stderr capture never sees it."""
    with contextlib.suppress(OSError):
        os.write(2, f"forkd-agent: {message}\n".encode(errors="replace"))


# --------------------------------------------------------------------------- parameters


def _require(req: dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = req.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):  # JSON true is not 1
        raise RequestError(f"{name!r} must be {what}")
    return value


def _optional(req: dict[str, Any], name: str, kind: type, what: str) -> Any:
    if req.get(name) is None:
        return None
    return _require(req, name, kind, what)


def _flag(req: dict[str, Any], name: str, default: bool = False) -> bool:
    value = req.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name!r} must be a boolean")
    return value


def _path(req: dict[str, Any], name: str = "path") -> str:
    value = req.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{name!r} must be a string")
    if not value.startswith("/"):
        raise RequestError(f"{name!r} must be an absolute path, got {value!r}")
    if "\0" in value:
        raise RequestError(f"{name!r} must not contain a NUL byte")
    return value


def _base64(req: dict[str, Any], name: str) -> bytes:
    text = _require(req, name, str, "a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{name!r} is not valid base64: {exc}") from None


# --------------------------------------------------------------------------- ping


def op_ping(req: dict[str, Any]) -> dict[str, Any]:
    return {
        "pong": True,
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "uptime_s": _uptime(),
        "agent_version": AGENT_VERSION,
        "features": ["payload"],  # reads a chunk sent raw after its request's line
        # What the original forkd agent's ping said too (docs/guest-agent.md):
        "agent_lang": "python",
        "numpy_version": _numpy_version(),
        "warmup_ready": WARMED_UP.is_set(),
    }


# Set once an eval has run without an error in this interpreter: a template's
# warmup is such an eval, so every fork of a warmed template starts with it set.
WARMED_UP = threading.Event()
# Where a container image's python3 keeps its packages (eval runs there, not in
# this interpreter): numpy's version is read from its metadata directory.
IMAGE_SITE_GLOBS = (
    "/usr/lib/python3/dist-packages",
    "/usr/lib/python3*/site-packages",
    "/usr/local/lib/python3*/site-packages",
    "/usr/local/lib/python3*/dist-packages",
    "/opt/*/lib/python3*/site-packages",
    "/opt/conda/lib/python3*/site-packages",
)


@functools.cache  # looked up at the first ping (a template's boot), kept in its memory
def _numpy_version() -> str:
    """numpy's version where eval runs (``not-installed`` without it): the metadata it was
    installed with, nothing is imported."""
    if IMAGE_EVAL is not None:
        return _image_package_version("numpy") or "not-installed"
    import importlib.metadata

    try:
        return importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"


def _image_package_version(name: str) -> str | None:
    for pattern in IMAGE_SITE_GLOBS:
        for site in sorted(glob.glob(pattern)):
            for meta in sorted(glob.glob(os.path.join(site, f"{name}-*.*-info"))):
                version = os.path.basename(meta)[len(name) + 1 :].rsplit(".", 1)[0]
                if version[:1].isdigit():  # not numpy-financial-1.0.egg-info
                    return version.split("-py", 1)[0]  # numpy-1.24.2-py3.11.egg-info
    return None


def _uptime() -> float:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic()


# --------------------------------------------------------------------------- exec


def _exec_params(req: dict[str, Any]) -> tuple[list[str], str | None, dict[str, str], Any, float]:
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise RequestError("'argv' must be a non-empty list of strings")
    if any("\0" in arg for arg in argv):
        raise RequestError("'argv' must not contain a NUL byte")
    cwd = _cwd(req)
    env = _env(req)
    stdin = _optional(req, "stdin", str, "a string or null")
    timeout = req.get("timeout")
    if timeout is None:
        timeout = DEFAULT_EXEC_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise RequestError("'timeout' must be a number of seconds")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise RequestError("'timeout' must be > 0 and finite")
    return argv, cwd, env, stdin, float(timeout)


def _env(req: dict[str, Any], home: str = "/root") -> dict[str, str]:
    """The base environment, the image's over it, then the request's ``env``."""
    extra = _optional(req, "env", dict, "an object of strings or null") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise RequestError("'env' must map strings to strings")
    for name, value in extra.items():
        if not name or "=" in name or "\0" in name + value:
            raise RequestError(f"'env' has an invalid variable: {name!r}")
    return {**BASE_ENV, "HOME": home, **IMAGE_DEFAULTS.env, **extra}


def _identity(req: dict[str, Any]) -> forkd_identity.Identity:
    """Who the request's command runs as: its ``user``, else the image's, else root."""
    user = _optional(req, "user", str, "a string or null") or IMAGE_DEFAULTS.user
    if user is None:
        return forkd_identity.ROOT
    try:
        return forkd_identity.resolve(user)
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _cwd(req: dict[str, Any]) -> str | None:
    cwd = _optional(req, "cwd", str, "a string or null")
    if cwd is not None and "\0" in cwd:
        raise RequestError("'cwd' must not contain a NUL byte")
    return cwd if cwd is not None else IMAGE_DEFAULTS.cwd


def _with_shell(argv: list[str]) -> list[str]:
    """``argv``, its /bin/sh swapped for forkd's own where the image has none."""
    if argv[0] == SHELL and not os.path.lexists(SHELL):
        return [*FALLBACK_SHELL, *argv[1:]]
    return argv


def op_configure(req: dict[str, Any]) -> dict[str, Any]:
    """Take the image's defaults (environment, working directory, user)."""
    global IMAGE_DEFAULTS
    try:
        defaults = forkd_identity.parse_defaults(req)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    forkd_identity.save_defaults(defaults)  # a respawned agent reads it back
    IMAGE_DEFAULTS = defaults
    if IMAGE_EVAL is not None:  # started under the old defaults: the next eval starts anew
        IMAGE_EVAL.stop()
    return {}


def op_exec(req: dict[str, Any]) -> dict[str, Any]:
    argv, cwd, _, stdin, timeout = _exec_params(req)
    who = _identity(req)
    env = _env(req, who.home)
    return forkd_exec.run(_with_shell(argv), cwd, env, stdin, timeout, who)


# --------------------------------------------------------------------------- eval
#
# forkd_eval.py runs the evals: one warm interpreter whose namespace is the
# __main__ module (installed as sys.modules["__main__"] by main(), so pickling
# user classes works), every eval on the main thread, where an interrupt
# (SIGINT) also wakes a blocking call. In a recipe image that interpreter is
# the agent's own, which is the image's Python. In a container image the agent's
# Python is forkd's (the runtime disk): evals go to IMAGE_EVAL, a worker in the
# image's own python3 that runs the same forkd_eval (forkd_eval_proc.py).

EVAL_MODULE = types.ModuleType("__main__")
EVAL = forkd_eval.EvalRunner(EVAL_MODULE)
IMAGE_EVAL: forkd_eval_proc.ImagePython | None = None  # set by main() in a container image


def _eval_launch() -> forkd_eval_proc.Launch:
    """The image's worker starts as its commands do: the image's env, directory, user."""
    who = _identity({})
    return forkd_eval_proc.Launch(env=_env({}, who.home), cwd=_cwd({}), identity=who)


def op_eval(req: dict[str, Any]) -> dict[str, Any]:
    with _request_errors():
        code, timeout_s = forkd_eval.eval_params(req)
    if IMAGE_EVAL is not None:
        answer = IMAGE_EVAL.run(code, timeout_s)
    else:
        answer = EVAL.run(code, timeout_s)
    if answer.get("error") is None:
        WARMED_UP.set()
    return answer


def op_eval_interrupt(req: dict[str, Any]) -> dict[str, Any]:
    runner = IMAGE_EVAL if IMAGE_EVAL is not None else EVAL
    return {"interrupted": runner.interrupt()}


# --------------------------------------------------------------------------- files


def op_file_read(req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        raise RequestError(f"not a regular file: {path}")
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise RequestError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return {"data": base64.b64encode(data).decode("ascii"), "size": len(data)}


def op_file_write(req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    data = _base64(req, "data")
    if len(data) > MAX_FILE_BYTES:
        raise RequestError(f"'data' is larger than {MAX_FILE_BYTES} bytes")
    mode = req.get("mode", 0o644)
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise RequestError("'mode' must be an integer permission value (0 to 0o7777)")
    if _flag(req, "append"):
        _write_append(path, data, mode)
    else:
        _write_atomic(path, data, mode)
    return {"size": len(data)}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            _wait_writable(fd)
            continue
        view = view[written:]


def _write_append(path: str, data: bytes, mode: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    existed = os.path.lexists(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, mode)
    try:
        if not existed:
            os.fchmod(fd, mode)  # the umask must not change a new file's mode
        _write_all(fd, data)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes, mode: int) -> None:
    # Write through a symlink, as open() would, instead of replacing the link.
    target = os.path.realpath(path) if os.path.islink(path) else path
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".forkd-write-", dir=parent)
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _entry_type(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def op_file_list(req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    names = sorted(os.listdir(path))  # NotADirectoryError / FileNotFoundError as they come
    entries = []
    for name in names[:MAX_LIST_ENTRIES]:
        try:
            st = os.lstat(os.path.join(path, name))
        except FileNotFoundError:  # removed while we listed
            continue
        entries.append(
            {
                "name": name,
                "type": _entry_type(st.st_mode),
                "size": st.st_size,
                "mode": stat.S_IMODE(st.st_mode),
                "mtime": st.st_mtime,
            }
        )
    return {"entries": entries, "truncated": len(names) > MAX_LIST_ENTRIES}


def op_file_remove(req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    if not os.path.normpath(path).strip("/"):
        raise RequestError("refusing to remove '/'")
    st = os.lstat(path)  # FileNotFoundError if missing; symlinks are never followed
    if stat.S_ISDIR(st.st_mode):
        if not _flag(req, "recursive"):
            raise IsADirectoryError(
                errno.EISDIR, "Is a directory (pass recursive=true to remove it)", path
            )
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return {"removed": True}


# --------------------------------------------------------------------------- background processes
#
# The proc_* ops: programs that outlive their request and the host connection,
# whose output waits in a ring per process. forkd_procs.py runs the processes;
# here are the parameters and the answers.

PROCESSES = forkd_procs.ProcessTable()
MAX_PROC_READ_BYTES = 1024 * 1024
DEFAULT_PROC_READ_BYTES = 256 * 1024
# The thread answering a proc_read runs ahead of the processes whose output it
# carries: on a guest with one busy vCPU, fair shares would leave it a third.
PROC_READ_NICE = -10
MAX_PROC_WAIT_S = 30.0
MAX_PROC_LINGER_S = 1.0
MAX_PROC_STDIN_BYTES = 1024 * 1024
MAX_PTY_SIDE = 1000  # columns or rows


def _int_param(
    req: dict[str, Any], name: str, low: int, high: int | None, default: int | None = None
) -> int:
    value = req.get(name)
    if value is None and default is not None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f"from {low} to {high}" if high is not None else f">= {low}"
        raise RequestError(f"{name!r} must be an integer {bounds}")
    return value


def _seconds_param(req: dict[str, Any], name: str, default: float, high: float) -> float:
    value = req.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
        raise RequestError(f"{name!r} must be a number of seconds from 0 to {high:g}")
    return float(value)


def _proc_argv(req: dict[str, Any]) -> list[str]:
    cmd = req.get("cmd")
    if isinstance(cmd, str) and cmd:
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, list) and cmd and all(isinstance(arg, str) for arg in cmd):
        argv = cmd
    else:
        raise RequestError("'cmd' must be a non-empty string or a non-empty list of strings")
    if any("\0" in arg for arg in argv):
        raise RequestError("'cmd' must not contain a NUL byte")
    return argv


def _proc_timeout(req: dict[str, Any]) -> float | None:
    timeout = req.get("timeout_s")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise RequestError("'timeout_s' must be a number of seconds or null")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise RequestError("'timeout_s' must be > 0 and finite")
    return float(timeout)


def _pty_size(req: dict[str, Any]) -> tuple[int, int] | None:
    """(cols, rows) of the requested pseudo-terminal, or None for pipes."""
    pty = req.get("pty")
    if pty is None:
        return None
    if not isinstance(pty, dict) or set(pty) != {"cols", "rows"}:
        raise RequestError('\'pty\' must be null or {"cols": int, "rows": int}')
    return _int_param(pty, "cols", 1, MAX_PTY_SIDE), _int_param(pty, "rows", 1, MAX_PTY_SIDE)


def _signal_param(req: dict[str, Any]) -> int:
    value = req.get("signal")
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        try:
            return int(signal.Signals[name])
        except KeyError:
            raise RequestError(f"unknown signal: {value!r}") from None
    if isinstance(value, int) and not isinstance(value, bool) and value in signal.valid_signals():
        return value
    raise RequestError('\'signal\' must be a signal number or a name like "SIGTERM" or "TERM"')


def _process(req: dict[str, Any]) -> forkd_procs.BackgroundProcess:
    """The process named by the request's ``pid`` (ProcessLookupError if none)."""
    return PROCESSES.get(_require(req, "pid", int, "an integer"))


@contextlib.contextmanager
def _request_errors() -> Iterator[None]:
    """The process manager's ValueErrors are about the request (no pty, offset too far)."""
    try:
        yield
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _proc_info(status: forkd_procs.ProcessStatus) -> dict[str, Any]:
    exit_code = None
    if status.returncode is not None:
        exit_code = EXIT_TIMEOUT if status.timed_out else forkd_exec.exit_code(status.returncode)
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


def op_proc_start(req: dict[str, Any]) -> dict[str, Any]:
    who = _identity(req)
    spec = forkd_procs.ProcessSpec(
        argv=_with_shell(_proc_argv(req)),
        env=_env(req, who.home),
        cwd=_cwd(req),
        identity=who,
        stdin=_flag(req, "stdin"),
        pty_size=_pty_size(req),
        timeout_s=_proc_timeout(req),
    )
    return _proc_info(PROCESSES.start(spec).status())


def op_proc_list(req: dict[str, Any]) -> dict[str, Any]:
    return {"processes": [_proc_info(proc.status()) for proc in PROCESSES.list()]}


def op_proc_info(req: dict[str, Any]) -> dict[str, Any]:
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
    offset = _int_param(req, "offset", 0, None)
    wait_s = _seconds_param(req, "wait_s", 0.0, MAX_PROC_WAIT_S)
    max_bytes = _int_param(req, "max_bytes", 1, MAX_PROC_READ_BYTES, DEFAULT_PROC_READ_BYTES)
    min_bytes = _int_param(req, "min_bytes", 1, MAX_PROC_READ_BYTES, 1)
    linger_s = _seconds_param(req, "linger_s", 0.0, MAX_PROC_LINGER_S)
    raw = _flag(req, "raw")
    proc = _process(req)
    with contextlib.suppress(OSError):  # this thread only; it ends with its answer
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PROC_READ_NICE)
    with _request_errors():
        output = proc.read(offset, max_bytes, wait_s, min(min_bytes, max_bytes), linger_s)
    info = _proc_info(output.status)
    # Built by hand: json.dumps would walk every character of the base64 again,
    # which costs more than the base64 itself on a slow (TCG) guest. With "raw",
    # the bytes follow the answer's line as they are, and chunks give their size:
    # one chunk for each run of one stream's pieces (the ring keeps each read apart).
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


def op_proc_stdin(req: dict[str, Any]) -> dict[str, Any]:
    data = _base64(req, "data")
    if len(data) > MAX_PROC_STDIN_BYTES:
        raise RequestError(f"'data' is larger than {MAX_PROC_STDIN_BYTES} bytes")
    eof = _flag(req, "eof")
    proc = _process(req)
    with _request_errors():
        return {"written": proc.write_stdin(data, eof)}


def op_proc_signal(req: dict[str, Any]) -> dict[str, Any]:
    signum = _signal_param(req)
    _process(req).send_signal(signum)
    return {}


def op_proc_resize(req: dict[str, Any]) -> dict[str, Any]:
    cols = _int_param(req, "cols", 1, MAX_PTY_SIDE)
    rows = _int_param(req, "rows", 1, MAX_PTY_SIDE)
    proc = _process(req)
    with _request_errors():
        proc.resize(cols, rows)
    return {}


# --------------------------------------------------------------------------- restore


def op_restore(req: dict[str, Any]) -> dict[str, Any]:
    """Make a VM restored from a snapshot unique again: clock, RNGs, hostname."""
    time_ns = _require(req, "time_ns", int, "an integer (ns since the epoch)")
    entropy = _base64(req, "entropy")
    if len(entropy) < MIN_ENTROPY_BYTES:
        raise RequestError(f"'entropy' must hold at least {MIN_ENTROPY_BYTES} bytes")
    hostname = _require(req, "hostname", str, "a string")
    dry = os.environ.get(DRY_RESTORE_ENV) == "1"

    errors: list[str] = []

    timings: dict[str, float] = {}

    def step(name: str, action: Callable[[], None], skip: bool = False) -> bool:
        if skip:
            errors.append(f"{name}: dry run")
            return False
        started = time.perf_counter()
        try:
            action()
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            log(f"restore: {name} failed: {exc}")
            return False
        finally:
            timings[name] = round((time.perf_counter() - started) * 1000, 2)
        return True

    # Order matters: the kernel RNG is reseeded before `random` draws from it.
    clock_set = step("clock", lambda: time.clock_settime_ns(time.CLOCK_REALTIME, time_ns), dry)
    rng_reseeded = step("rng", lambda: _reseed_kernel_rng(entropy), dry)
    random_reseeded = step("random", _reseed_python_rngs)
    hostname_set = step("hostname", lambda: _set_hostname(hostname), dry)
    return {
        "clock_set": clock_set,
        "rng_reseeded": rng_reseeded,
        "random_reseeded": random_reseeded,
        "hostname_set": hostname_set,
        "errors": errors,
        "timings_ms": timings,
    }


def _reseed_kernel_rng(entropy: bytes) -> None:
    # struct rand_pool_info { int entropy_count (bits); int buf_size; __u32 buf[]; }
    info = struct.pack("ii", len(entropy) * 8, len(entropy)) + entropy
    fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, info)
        # Rekey the crng now; otherwise clones of one memory image keep sharing
        # os.urandom output until the kernel's next periodic reseed.
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


def _reseed_python_rngs() -> None:
    # An int seed: a bytes one is first hashed with SHA-512, which a fresh TCG
    # fork pays to translate. The image's eval worker, if one runs, too: sibling
    # forks must not draw the same numbers there either.
    forkd_eval.reseed_python_rngs(int.from_bytes(os.urandom(32), "little"))
    if IMAGE_EVAL is not None:
        IMAGE_EVAL.reseed(int.from_bytes(os.urandom(32), "little"))


def _set_hostname(hostname: str) -> None:
    # Only the kernel's name: /etc/hostname is not rewritten, since the first
    # write to it copies the file up into the overlay and costs ~30 ms of the
    # fork under TCG.
    socket.sethostname(hostname)


# --------------------------------------------------------------------------- dispatch

OPS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "ping": op_ping,
    "exec": op_exec,
    "eval": op_eval,
    "eval_interrupt": op_eval_interrupt,
    "file_read": op_file_read,
    "file_write": op_file_write,
    "file_list": op_file_list,
    "file_remove": op_file_remove,
    "restore": op_restore,
    "configure": op_configure,
    "proc_start": op_proc_start,
    "proc_list": op_proc_list,
    "proc_info": op_proc_info,
    "proc_read": op_proc_read,
    "proc_stdin": op_proc_stdin,
    "proc_signal": op_proc_signal,
    "proc_resize": op_proc_resize,
}
OPS.update(forkd_files.OPS)  # chunked uploads, ranged reads, tar streams


# Quick ops answered on the reader thread itself. For ``restore`` this also
# means no request read after it can run before the clock and RNGs are fixed.
INLINE_OPS = frozenset({"ping", "restore"})


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode("ascii") + b"\n"


# An op's result already encoded as one JSON object, in pieces: answered as it is,
# joined once with the answer around it (each copy of a large answer costs).
# Defined beside the chunked transfers, whose reads answer so too.
EncodedJSON = forkd_files.EncodedJSON


# An encoded result whose ``raw`` bytes are sent after the answer's line as they are,
# announced by ``"raw":K`` second in it (proc_read, file reads: no base64 to make).
WithRawBytes = forkd_files.WithRawBytes


def _error_message(req_id: int, exc: BaseException) -> dict[str, Any]:
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
        return _encode({"id": req_id, "ok": True, "result": result})
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: still one answer
        if not isinstance(exc, OSError | RequestError):
            log(f"request {req_id} failed: {type(exc).__name__}: {exc}")
        return _encode(_error_message(req_id, exc))


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


# --------------------------------------------------------------------------- transport


def _wait_writable(fd: int) -> None:
    """Wait until a non-blocking fd accepts data; raise if the peer went away."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    while True:
        for _, events in poller.poll(1000):
            if events & select.POLLOUT:
                return
            if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                raise ConnectionError("peer disconnected")


def _read_chunk(fd: int) -> bytes:
    """One read; waits with poll() when the fd is non-blocking and empty."""
    return _read_when_ready(lambda: os.read(fd, READ_CHUNK_BYTES), fd)


def _read_into(fd: int, space: memoryview) -> int:
    """One read into ``space``: how many bytes; waits as :func:`_read_chunk` does."""
    return _read_when_ready(lambda: os.readv(fd, [space]), fd)


def _read_when_ready(read: Callable[[], T], fd: int) -> T:
    poller: select.poll | None = None
    while True:
        try:
            return read()
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
            events = poller.poll()  # no timeout: an idle guest wakes for nothing here
            if events and not any(ev & select.POLLIN for _, ev in events):
                time.sleep(DEVICE_REOPEN_DELAY_S)  # HUP without data: do not spin


# A request whose head is ``{"id":N,"payload":K,`` is followed, after its newline,
# by K bytes that belong to it (an upload's chunk: no base64 for the guest to decode).
_PAYLOAD_HEAD = re.compile(rb'\s*\{\s*"id"\s*:\s*\d{1,20}\s*,\s*"payload"\s*:\s*(\d{1,10})\s*[,}]')
MAX_PAYLOAD_BYTES = forkd_files.MAX_CHUNK_BYTES


class LineSplitter:
    """Split a byte stream into requests: ``(line, payload)``, where ``payload`` is
    the raw bytes a line's head announced (None when it announced none). Lines
    longer than MAX_LINE_BYTES are dropped, and so is a payload over
    MAX_PAYLOAD_BYTES (its bytes are skipped, never read as lines).

    While a payload is awaited, :meth:`payload_space` is where the next read may
    go straight (no slices, no per-read bytes objects: a virtio-serial read
    returns one 4 KiB buffer, so a 1 MiB chunk is 256 reads)."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_line
        self._discarding = False
        self._line: bytes | None = None  # a line whose payload is still coming
        self._payload = bytearray()
        self._filled = 0  # of the payload
        self._payload_left = 0

    def feed(self, chunk: bytes) -> Iterator[tuple[bytes, bytearray | None]]:
        if self._payload_left:
            chunk = yield from self._take_payload(chunk)
        scan_from = len(self._buf)
        self._buf += chunk
        start = 0
        while (end := self._buf.find(b"\n", scan_from)) >= 0:
            line = bytes(self._buf[start:end])
            start = scan_from = end + 1
            if self._discarding:
                self._discarding = False
                continue
            announced = _PAYLOAD_HEAD.match(line)
            if announced is None:
                yield line, None
                continue
            self._await_payload(line, int(announced.group(1)))
            rest = yield from self._take_payload(bytes(self._buf[start:]))
            self._buf[:] = rest
            start = scan_from = 0
        del self._buf[:start]
        if len(self._buf) > self._max:
            log(f"dropping a request line longer than {self._max} bytes")
            self._buf.clear()
            self._discarding = True

    def payload_space(self) -> memoryview | None:
        """Where the rest of an awaited payload goes; None when none is awaited."""
        if not self._payload_left or self._line is None:
            return None
        return memoryview(self._payload)[self._filled :]

    def payload_read(self, n: int) -> Iterator[tuple[bytes, bytearray | None]]:
        """``n`` bytes were read into :meth:`payload_space`; the request, once whole."""
        self._filled += n
        self._payload_left -= n
        if not self._payload_left:
            yield from self._complete()

    def _await_payload(self, line: bytes, size: int) -> None:
        if size > MAX_PAYLOAD_BYTES:
            log(f"dropping a request whose payload is over {MAX_PAYLOAD_BYTES} bytes")
            self._line, self._payload = None, bytearray()
        else:
            self._line, self._payload = line, bytearray(size)
        self._filled, self._payload_left = 0, size

    def _take_payload(self, chunk: bytes) -> Iterator[tuple[bytes, bytearray | None]]:
        """Take the awaited payload's bytes from ``chunk``; yield the request when
        they are all here. Returns what of ``chunk`` follows them."""
        n = min(self._payload_left, len(chunk))
        if self._line is not None:
            self._payload[self._filled : self._filled + n] = memoryview(chunk)[:n]
            self._filled += n
        self._payload_left -= n
        if not self._payload_left:
            yield from self._complete()
        return chunk[n:]

    def _complete(self) -> Iterator[tuple[bytes, bytearray | None]]:
        line, self._line = self._line, None
        payload, self._payload = self._payload, bytearray()
        if line is not None:
            yield line, payload


class Workers:
    """Threads for requests, kept for the next request once done.

    Every request gets a thread at once (a slow eval never holds up an exec),
    but an idle thread is reused rather than a new one started: a forked VM
    inherits the template's idle threads, so its first requests start none.
    Under TCG each new guest thread costs a fresh VM thousands of translated
    blocks. At most ``keep`` idle threads wait, blocked, costing no wakeups.
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for work and not yet promised any
        self._work: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._local = threading.local()

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._work.put(work)
            if self._idle:
                self._idle -= 1  # an idle thread is promised to the work just put
                return
        # No idle thread: a new one takes the work (this one, or an equal one put
        # meanwhile). Passed through the queue, not the thread's arguments, which
        # would keep the request (and its payload) alive as long as the thread.
        threading.Thread(target=self._run, name="request", daemon=True).start()

    def release(self) -> None:
        """Count the calling worker idle now, just before its answer goes out: the host
        sends the next request as soon as it reads the answer, and that request must
        find this thread, not start one. (The thread takes it once its answer is sent.)
        A no-op outside a worker, or called twice."""
        state = getattr(self._local, "state", None)
        if state is None or state[0]:
            return
        with self._lock:
            kept = self._idle < self._keep
            if kept:
                self._idle += 1
        self._local.state = (True, kept)

    def _run(self) -> None:
        while True:
            work: Callable[[], None] | None = self._work.get()
            self._local.state = (False, False)  # (released, kept as idle)
            try:
                assert work is not None
                work()
            except Exception as exc:  # a request's own errors are answered; this is a bug
                log(f"request worker: {type(exc).__name__}: {exc}")
            work = None  # an idle thread holds no finished request
            released, kept = self._local.state
            self._local.state = None
            if released:
                if kept:
                    continue
                return
            with self._lock:
                if self._idle >= self._keep:
                    return
                self._idle += 1

    def idle(self) -> int:
        with self._lock:
            return self._idle

    def prestart(self) -> None:
        """One idle thread now, so a snapshot taken before any request has one."""
        self.submit(lambda: None)


WORKERS = Workers()


class Connection:
    """One host connection: whole-line writes under a lock, in-flight tracking."""

    def __init__(self, fd: int, close: Callable[[], None]) -> None:
        self.fd = fd
        self._close = close
        self._write_lock = threading.Lock()
        self._closed = False
        self._inflight = 0
        self._idle = threading.Condition()

    def send(self, line: bytes, req_id: int) -> None:
        with self._write_lock:
            if self._closed:
                log(f"dropping the answer to {req_id}: connection closed")
                return
            try:
                _write_all(self.fd, line)
            except OSError as exc:
                log(f"dropping the answer to {req_id}: {exc}")

    def dispatch(self, line: bytes, payload: bytearray | None = None) -> None:
        parsed = parse_request(line)
        if parsed is None:
            return
        req_id, req = parsed
        if payload is not None:
            req["data"] = payload  # in place of base64: bytes no JSON line can hold
        with self._idle:
            self._inflight += 1
        if req.get("op") in INLINE_OPS:
            self._serve_one(req_id, req)
            return
        try:
            WORKERS.submit(lambda: self._serve_one(req_id, req))
        except RuntimeError as exc:  # cannot start a thread: answer inline
            self._finish(req_id, _encode(_error_message(req_id, exc)))

    def _serve_one(self, req_id: int, req: dict[str, Any]) -> None:
        line = handle_request(req_id, req)
        WORKERS.release()  # idle before the answer is out: the next request finds this thread
        self._finish(req_id, line)

    def _finish(self, req_id: int, line: bytes) -> None:
        try:
            self.send(line, req_id)
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def wait_idle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0)

    def close(self) -> None:
        with self._write_lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(OSError):
                    self._close()


def serve_stream(conn: Connection, read_fd: int) -> None:
    """Read requests from ``read_fd`` until EOF or a read error."""
    splitter = LineSplitter()
    while True:
        space = splitter.payload_space()
        try:
            if space is not None:  # a payload: read straight into its buffer
                n = _read_into(read_fd, space)
                requests = splitter.payload_read(n)
            else:
                chunk = _read_chunk(read_fd)
                n = len(chunk)
                requests = splitter.feed(chunk)
        except OSError as exc:
            log(f"read failed: {exc}")
            return
        if not n:
            return
        for line, payload in requests:
            conn.dispatch(line, payload)


def find_agent_port(name: str = PORT_NAME) -> str | None:
    """/dev path of the virtio-serial port called ``name``, if it exists yet."""
    for name_file in sorted(glob.glob(os.path.join(VIRTIO_PORTS_DIR, "*", "name"))):
        try:
            with open(name_file) as f:
                if f.read().strip() != name:
                    continue
        except OSError:
            continue
        return os.path.join("/dev", os.path.basename(os.path.dirname(name_file)))
    return None


def announce(conn: Connection, restart_mark: str | None) -> None:
    """Tell the host that requests it sent to an earlier agent process (one that
    crashed, e.g. user code in eval hit SIGSEGV) are lost.

    A restarted agent (``restart_mark`` exists) first ends whatever its
    predecessor was cut off in: the rest of an answer's line and the raw bytes
    it announced (a proc_read's or a file read's, at most 1 MiB), so the host
    reads the event as a line. What is left of the filler is blank lines."""
    if restart_mark is not None and os.path.exists(restart_mark):
        most_raw = max(MAX_PROC_READ_BYTES, forkd_files.MAX_CHUNK_BYTES)
        filler = b" " * (most_raw + 1) + b"\n"
        conn.send(filler * 2, 0)  # a cut line, then its raw bytes
    conn.send(_encode({"event": "started", "pid": os.getpid()}), 0)
    if restart_mark is not None:
        with contextlib.suppress(OSError), open(restart_mark, "w"):
            pass


def serve_device(path: str | None) -> None:
    """Serve the virtio-serial port forever.

    While no host is connected, read() returns EOF at once; the port is then
    closed and reopened. Answers to requests of a closed connection are dropped.
    The fd is non-blocking so that an answer written while the host is away is
    dropped (POLLHUP) instead of blocking until some later host connects.
    """
    device = path
    last_problem: str | None = ""  # "" = nothing logged yet
    announced = False
    while True:
        try:
            if device is None and (device := find_agent_port()) is None:
                raise FileNotFoundError(f"no virtio-serial port named {PORT_NAME!r} yet")
            fd = os.open(device, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as exc:
            if str(exc) != last_problem:
                log(f"waiting for the port: {exc}")
                last_problem = str(exc)
            time.sleep(DEVICE_RETRY_S)
            continue
        if last_problem is not None:
            log(f"serving {device}")
            last_problem = None
        conn = Connection(fd, lambda fd=fd: os.close(fd))
        if not announced:
            announce(conn, RESTART_MARK if path is None else None)
            announced = True
        try:
            serve_stream(conn, fd)
        finally:
            conn.close()
        time.sleep(DEVICE_REOPEN_DELAY_S)


def serve_socket(path: str) -> None:
    """Listen on a unix socket; each connection is served in its own thread."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    log(f"listening on {path}")
    while True:
        sock, _ = server.accept()
        threading.Thread(target=_serve_socket_conn, args=(sock,), daemon=True).start()


def _serve_socket_conn(sock: socket.socket) -> None:
    conn = Connection(sock.fileno(), sock.close)
    try:
        serve_stream(conn, sock.fileno())
        conn.wait_idle()  # the peer may only have shut down its sending side
    finally:
        conn.close()


def serve_stdio() -> None:
    """Requests on stdin, answers on stdout; exits at EOF once all are answered."""
    in_fd, out_fd = os.dup(0), os.dup(1)
    # Keep stray output (os.system in eval, child processes) off the protocol stream.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    conn = Connection(out_fd, lambda: os.close(out_fd))
    serve_stream(conn, in_fd)
    conn.wait_idle()
    conn.close()


# --------------------------------------------------------------------------- TCP port 8888
#
# The original forkd agent protocol, which the host reaches at a sandbox's
# guest_addr: one JSON request per connection, one JSON answer, then close.
# Every limit below keeps a client that is slow, silent, huge or numerous
# from holding the agent: the virtio-serial channel never waits on it.


def _tcp_exec(req: dict[str, Any]) -> dict[str, Any]:
    """``exec`` in the HTTP API's words (``args``, ``timeout_secs``), or the original
    forkd SDK's (``timeout``)."""
    args = req.get("args")
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        raise RequestError("'args' must be a non-empty list of strings")
    given = {k: req[k] for k in ("timeout_secs", "timeout") if req.get(k) is not None}
    for field, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(f"'{field}' must be a number of seconds")
        if not (0 < value <= MAX_EXEC_TIMEOUT_S):  # NaN fails this too
            raise RequestError(f"'{field}' must be > 0 and at most {MAX_EXEC_TIMEOUT_S:g}")
    if len(set(given.values())) > 1:
        raise RequestError("'timeout_secs' and 'timeout' differ: give one of them")
    timeout = next(iter(given.values()), DEFAULT_EXEC_TIMEOUT_S)
    params = {k: req.get(k) for k in ("cwd", "env", "stdin", "user")}
    return op_exec({"argv": args, "timeout": timeout, **params})


def _tcp_eval(req: dict[str, Any]) -> dict[str, Any]:
    """``eval`` answered as the original forkd agent did: a failure's ``error`` is its
    last line (``NameError: name 'x' is not defined``), the whole text in
    ``traceback``."""
    answer = op_eval(req)
    error = answer.get("error")
    if error:
        lines = [line for line in error.splitlines() if line.strip()]
        answer["traceback"] = error
        answer["error"] = lines[-1].strip() if lines else error
    return answer


TCP_ACTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "ping": op_ping,
    "exec": _tcp_exec,
    "eval": _tcp_eval,  # the same warm interpreter as the virtio-serial channel's
}


def _tcp_error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def handle_tcp_request(data: bytes) -> dict[str, Any]:
    """The answer to one TCP request (the bytes before its newline)."""
    if not data.strip():
        return _tcp_error("empty request: send one JSON object and a newline")
    try:
        req = json.loads(data)
    except ValueError:  # includes UnicodeDecodeError
        return _tcp_error("the request is not JSON")
    if not isinstance(req, dict):
        return _tcp_error("the request must be a JSON object")
    action = req.get("action")
    handler = TCP_ACTIONS.get(action) if isinstance(action, str) else None
    if handler is None:
        return _tcp_error(f"unknown action: {action!r} (expected one of {', '.join(TCP_ACTIONS)})")
    try:
        answer = handler(req)
        # The original forkd client takes an 'error' key, even a null one, as a failure.
        if "error" in answer and answer["error"] is None:
            del answer["error"]
        return {"ok": True, **answer}
    except BaseException as exc:  # the connection still gets its one answer
        if not isinstance(exc, OSError | RequestError):
            log(f"tcp {action} failed: {type(exc).__name__}: {exc}")
        return _tcp_error(str(exc) or type(exc).__name__)


class TcpServer:
    """Serve the one-request-per-connection protocol, each client in a thread."""

    def __init__(
        self,
        host: str = TCP_HOST,
        port: int = TCP_PORT,
        *,
        max_connections: int = TCP_MAX_CONNECTIONS,
        max_request_bytes: int = TCP_MAX_REQUEST_BYTES,
        read_timeout_s: float = TCP_READ_TIMEOUT_S,
        write_timeout_s: float = TCP_WRITE_TIMEOUT_S,
    ) -> None:
        self.host, self.port = host, port
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._listener: socket.socket | None = None
        self._closed = False

    def bind(self) -> tuple[str, int]:
        """Listen now; the address actually bound (port 0 picks a free one)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(TCP_BACKLOG)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        return sock.getsockname()[:2]

    def start(self) -> threading.Thread:
        """Bind (retrying until it works) and serve, in a background thread."""
        thread = threading.Thread(target=self._bind_and_serve, name="tcp-accept", daemon=True)
        thread.start()
        return thread

    def _bind_and_serve(self) -> None:
        last_problem = ""
        while self._listener is None and not self._closed:
            try:
                self.bind()
            except OSError as exc:
                if str(exc) != last_problem:
                    log(f"cannot listen on tcp {self.host}:{self.port} yet: {exc}")
                    last_problem = str(exc)
                time.sleep(TCP_BIND_RETRY_S)
        log(f"listening on tcp {self.host}:{self.port}")
        self.serve_forever()

    def serve_forever(self) -> None:
        listener = self._listener
        assert listener is not None, "bind() first"
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log(f"tcp accept failed: {exc}")
                    time.sleep(TCP_BIND_RETRY_S)  # let connections finish, do not spin
                continue
            if not self._slots.acquire(blocking=False):
                _refuse(conn, f"too many connections (at most {self.max_connections})")
                continue
            try:
                threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
            except RuntimeError:  # cannot start a thread
                self._slots.release()
                _refuse(conn, "the agent cannot start a thread")

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()
            self._listener.close()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            with conn:
                data, problem = self._read_request(conn)
                answer = _tcp_error(problem) if problem else handle_tcp_request(data)
                self._answer(conn, answer)
        except ConnectionError:
            pass  # the client reset or left: its own business
        except OSError as exc:
            log(f"tcp connection: {exc}")
        finally:
            self._slots.release()

    def _read_request(self, conn: socket.socket) -> tuple[bytes, str | None]:
        """The bytes before the first newline (or EOF), or why there are none."""
        deadline = time.monotonic() + self.read_timeout_s
        buf = bytearray()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return b"", f"no complete request within {self.read_timeout_s:g} s"
            conn.settimeout(remaining)
            try:
                chunk = conn.recv(READ_CHUNK_BYTES)
            except TimeoutError:
                continue
            scan_from = len(buf)
            buf += chunk
            end = buf.find(b"\n", scan_from)
            if end < 0 and chunk:  # not complete yet
                if len(buf) > self.max_request_bytes:
                    break
                continue
            request = bytes(buf[:end]) if end >= 0 else bytes(buf)  # else: EOF ends it
            if len(request) > self.max_request_bytes:
                break
            return request, None
        return b"", f"request larger than {self.max_request_bytes} bytes"

    def _answer(self, conn: socket.socket, answer: dict[str, Any]) -> None:
        """Send the answer, then read what the client still sends for a moment:
        closing with unread data would reset the connection, and the client
        could lose the answer."""
        deadline = time.monotonic() + self.write_timeout_s
        view = memoryview(_encode(answer))
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log("tcp client did not take its answer in time")
                return
            conn.settimeout(remaining)
            with contextlib.suppress(TimeoutError):
                view = view[conn.send(view) :]
        conn.shutdown(socket.SHUT_WR)
        drain_end = time.monotonic() + TCP_DRAIN_S
        drained = 0
        while drained <= self.max_request_bytes and (left := drain_end - time.monotonic()) > 0:
            conn.settimeout(left)
            try:
                chunk = conn.recv(READ_CHUNK_BYTES)
            except (TimeoutError, OSError):
                return
            if not chunk:
                return
            drained += len(chunk)


def _refuse(conn: socket.socket, message: str) -> None:
    """Close at once, without waiting for anything; say why if the socket takes it.

    A request that already arrived is read and dropped first (up to one
    chunk): closing with unread data would reset the connection and lose
    the reason."""
    with conn, contextlib.suppress(OSError):
        conn.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            conn.recv(READ_CHUNK_BYTES)
        conn.send(_encode(_tcp_error(message)))
        conn.shutdown(socket.SHUT_WR)


def _tcp_address(text: str) -> tuple[str, int] | None:
    """``[HOST:]PORT`` for --tcp, or None for ``off``."""
    if text == "off":
        return None
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--tcp: expected [HOST:]PORT or 'off', got {text!r}")
    return host or TCP_HOST, int(port)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``tcp`` comes back as ``(host, port)`` or None."""
    parser = argparse.ArgumentParser(description="forkd guest agent")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--device", help="serve this character device instead of the 'agent' port")
    mode.add_argument("--socket", help="serve a unix socket at this path (host tests)")
    mode.add_argument("--stdio", action="store_true", help="serve stdin/stdout")
    parser.add_argument(
        "--tcp",
        metavar="[HOST:]PORT|off",
        help=f"also serve the TCP protocol here (default: {TCP_HOST}:{TCP_PORT} when "
        "serving the virtio port, off with --socket and --stdio)",
    )
    parser.add_argument(
        "--eval-in",
        choices=("auto", "agent", "image"),
        default="auto",
        help="where eval runs: this interpreter ('agent', a recipe image), a worker in the "
        "image's python3 ('image', a container image), or 'auto': 'image' when this agent "
        f"runs from forkd's runtime ({forkd_eval_proc.RUNTIME_PREFIX})",
    )
    parser.add_argument(
        "--defaults-file",
        default=forkd_identity.DEFAULTS_FILE,
        help="where the image's defaults (the configure op) are kept (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.tcp is None:
        args.tcp = "off" if (args.socket or args.stdio) else f"{TCP_HOST}:{TCP_PORT}"
    try:
        args.tcp = _tcp_address(args.tcp)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    global IMAGE_DEFAULTS, IMAGE_EVAL
    args = parse_args(argv)
    forkd_identity.DEFAULTS_FILE = args.defaults_file
    IMAGE_DEFAULTS = forkd_identity.load_defaults()  # a respawned agent: what it was told
    if args.eval_in == "image" or (args.eval_in == "auto" and forkd_eval_proc.in_runtime()):
        IMAGE_EVAL = forkd_eval_proc.ImagePython(_eval_launch)
    sys.modules["__main__"] = EVAL_MODULE  # eval's namespace is the __main__ module
    # Evals run on this, the main thread: only it can be interrupted in a
    # blocking call. Claimed before any request can arrive.
    EVAL.claim_thread()
    WORKERS.prestart()  # every snapshot, even one taken before a request, has an idle one
    if args.tcp is not None:
        # From the template's boot on, so every fork inherits a listening socket.
        TcpServer(*args.tcp).start()
    if args.stdio:
        serve: Callable[[], None] = serve_stdio
    elif args.socket:
        serve = lambda: serve_socket(args.socket)  # noqa: E731
    else:
        serve = lambda: serve_device(args.device)  # noqa: E731
    exit_code: list[int] = []
    serving = threading.Thread(target=_serve_then_stop, args=(serve, exit_code), name="serve")
    serving.daemon = True
    serving.start()
    EVAL.serve_forever()
    return exit_code[0] if exit_code else 0


def _serve_then_stop(serve: Callable[[], None], exit_code: list[int]) -> None:
    """Serve the host; when that ends (stdio at EOF) or fails, the agent exits."""
    try:
        serve()
        exit_code.append(0)
    except BaseException as exc:
        log(f"serving failed: {type(exc).__name__}: {exc}")
        exit_code.append(1)
    finally:
        EVAL.stop()


if __name__ == "__main__":
    sys.exit(main())
