"""The guest agent's request handlers: each op (``ping``, ``exec``, ``eval``, the
whole-file ops, ``restore``, ``configure``) takes a request and returns its result.

The background processes' ops are in forkd_agent_proc_handlers.py, the chunked
transfers' in forkd_files.py; forkd_agent_protocol.py merges the three tables.
Imported from the agent's own directory. Standard library only.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import functools
import glob
import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import forkd_agent_command as command
import forkd_agent_params as params
import forkd_eval
import forkd_eval_contexts
import forkd_eval_proc
import forkd_exec
import forkd_identity
from forkd_agent_log import log
from forkd_agent_params import RequestError
from forkd_entries import kind_of
from forkd_tar import write_all

from forkd import agent_wire as wire
from forkd.agent_wire import MAX_FILE_BYTES, MAX_LIST_ENTRIES

AGENT_VERSION = "1"

# linux/random.h
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
MIN_ENTROPY_BYTES = 32
DRY_RESTORE_ENV = "FORKD_AGENT_DRY_RESTORE"  # "1": restore skips clock, kernel RNG, hostname

Handler = Callable[[dict[str, Any]], Mapping[str, object]]


# --------------------------------------------------------------------------- ping


def op_ping(req: dict[str, Any]) -> wire.PingAnswer:
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
    argv = params.exec_argv(req)
    cwd = command.cwd(req)
    env = command.env(req)
    stdin = params.optional(req, "stdin", str, "a string or null")
    return argv, cwd, env, stdin, params.exec_timeout(req)


def op_configure(req: dict[str, Any]) -> wire.Empty:
    """Take the image's defaults (environment, working directory, user)."""
    with params.request_errors():
        defaults = forkd_identity.parse_defaults(req)
    forkd_identity.save_defaults(defaults)  # a respawned agent reads it back
    command.set_image_defaults(defaults)
    if IMAGE_EVAL is not None:  # started under the old defaults: the next eval starts anew
        IMAGE_EVAL.stop()
    return {}


def op_env_set(req: dict[str, Any]) -> wire.Empty:
    """Add variables to the image's environment (E2B's envVars), and with ``cwd`` or
    ``user`` make them the default of commands (an E2B template's WORKDIR and USER):
    every command started from now has them; a running eval worker keeps what it has."""
    if not isinstance(req.get("env"), dict):
        raise RequestError("'env' must map names (no '=', no NUL) to strings")
    with params.request_errors():
        given = forkd_identity.parse_defaults(req)
    current = command.IMAGE_DEFAULTS
    merged = forkd_identity.ImageDefaults(
        {**current.env, **given.env}, given.cwd or current.cwd, given.user or current.user
    )
    forkd_identity.save_defaults(merged)  # a respawned agent reads it back
    command.set_image_defaults(merged)
    return {}


def op_exec(req: dict[str, Any]) -> wire.ExecAnswer:
    argv, cwd, _, stdin, timeout = _exec_params(req)
    who = command.identity(req)
    env = command.env(req, who.home)
    return forkd_exec.run(command.with_shell(argv), cwd, env, stdin, timeout, who)


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
IMAGE_EVAL: forkd_eval_proc.ImagePython | None = None  # set by use_image_python()


def use_image_python() -> None:
    """Run evals in the image's own python3 (a container image), not in this interpreter."""
    global IMAGE_EVAL
    IMAGE_EVAL = forkd_eval_proc.ImagePython(_eval_launch)


def _eval_launch() -> forkd_eval_proc.Launch:
    """The image's worker starts as its commands do: the image's env, directory, user."""
    who = command.identity({})
    return forkd_eval_proc.Launch(env=command.env({}, who.home), cwd=command.cwd({}), identity=who)


def _launch_in(cwd: str | None) -> forkd_eval_proc.Launch:
    """An eval context's worker: as the image's, in the directory the context names."""
    launch = _eval_launch()
    return forkd_eval_proc.Launch(env=launch.env, cwd=cwd or launch.cwd, identity=launch.identity)


# E2B's code interpreter contexts: workers of their own (forkd_eval_contexts.py).
CONTEXTS = forkd_eval_contexts.Contexts(_launch_in)


def op_eval(req: dict[str, Any]) -> wire.EvalAnswer:
    with params.request_errors():
        code, timeout_s = forkd_eval.eval_params(req)
        context = forkd_eval_contexts.context_param(req)
    tag = req.get("tag") if isinstance(req.get("tag"), str) else None
    if context is not None:
        return CONTEXTS.get(context).run(code, timeout_s, tag)
    if IMAGE_EVAL is not None:
        answer = IMAGE_EVAL.run(code, timeout_s, tag)
    else:
        answer = EVAL.run(code, timeout_s, tag)
    if answer.get("error") is None:
        WARMED_UP.set()
    return answer


def op_eval_interrupt(req: dict[str, Any]) -> wire.EvalInterruptAnswer:
    with params.request_errors():
        context = forkd_eval_contexts.context_param(req or {})
    tag = req.get("tag") if req and isinstance(req.get("tag"), str) else None
    if context is not None:
        return {"interrupted": CONTEXTS.get(context).interrupt(tag)}
    runner = IMAGE_EVAL if IMAGE_EVAL is not None else EVAL
    return {"interrupted": runner.interrupt(tag)}


def op_eval_context_open(req: dict[str, Any]) -> wire.EvalContextOpenAnswer:
    with params.request_errors():
        return CONTEXTS.open(req)  # type: ignore[return-value]


def op_eval_context_close(req: dict[str, Any]) -> wire.EvalContextCloseAnswer:
    with params.request_errors():
        return CONTEXTS.close(req)  # type: ignore[return-value]


def op_eval_peek(req: dict[str, Any]) -> wire.EvalPeekAnswer:
    """What a running eval printed so far (the agent's own interpreter; an image's
    worker answers not running: its output comes with its answer)."""
    tag = params.require(req, "tag", str, "a string")
    stdout_from = params.int_param(req, "stdout_from", 0, None, default=0)
    stderr_from = params.int_param(req, "stderr_from", 0, None, default=0)
    if IMAGE_EVAL is not None:
        return {"running": False, "stdout": "", "stderr": ""}
    return EVAL.peek(tag, stdout_from, stderr_from)


# --------------------------------------------------------------------------- files


def op_file_read(req: dict[str, Any]) -> wire.FileReadAnswer:
    path = params.path(req)
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


def op_file_write(req: dict[str, Any]) -> wire.SizeAnswer:
    path = params.path(req)
    data = params.base64_bytes(req, "data")
    if len(data) > MAX_FILE_BYTES:
        raise RequestError(f"'data' is larger than {MAX_FILE_BYTES} bytes")
    mode = req.get("mode", 0o644)
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise RequestError("'mode' must be an integer permission value (0 to 0o7777)")
    if params.flag(req, "append"):
        _write_append(path, data, mode)
    else:
        _write_atomic(path, data, mode)
    return {"size": len(data)}


def _write_append(path: str, data: bytes, mode: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    existed = os.path.lexists(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, mode)
    try:
        if not existed:
            os.fchmod(fd, mode)  # the umask must not change a new file's mode
        write_all(fd, data)
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
            write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def op_file_list(req: dict[str, Any]) -> wire.FileListAnswer:
    path = params.path(req)
    names = sorted(os.listdir(path))  # NotADirectoryError / FileNotFoundError as they come
    entries: list[wire.FileListEntry] = []
    for name in names[:MAX_LIST_ENTRIES]:
        try:
            st = os.lstat(os.path.join(path, name))
        except FileNotFoundError:  # removed while we listed
            continue
        entries.append(
            {
                "name": name,
                "type": kind_of(st.st_mode),
                "size": st.st_size,
                "mode": stat.S_IMODE(st.st_mode),
                "mtime": st.st_mtime,
            }
        )
    return {"entries": entries, "truncated": len(names) > MAX_LIST_ENTRIES}


def op_file_remove(req: dict[str, Any]) -> wire.FileRemoveAnswer:
    path = params.path(req)
    if not os.path.normpath(path).strip("/"):
        raise RequestError("refusing to remove '/'")
    st = os.lstat(path)  # FileNotFoundError if missing; symlinks are never followed
    if stat.S_ISDIR(st.st_mode):
        if not params.flag(req, "recursive"):
            raise IsADirectoryError(
                errno.EISDIR, "Is a directory (pass recursive=true to remove it)", path
            )
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return {"removed": True}


# --------------------------------------------------------------------------- restore


def op_restore(req: dict[str, Any]) -> wire.RestoreAnswer:
    """Make a VM restored from a snapshot unique again: clock, RNGs, hostname."""
    time_ns = params.require(req, "time_ns", int, "an integer (ns since the epoch)")
    entropy = params.base64_bytes(req, "entropy")
    if len(entropy) < MIN_ENTROPY_BYTES:
        raise RequestError(f"'entropy' must hold at least {MIN_ENTROPY_BYTES} bytes")
    hostname = params.require(req, "hostname", str, "a string")
    seed = req.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 1 << 63):
        raise RequestError("'seed' must be a non-negative integer")
    keep_random = req.get("keep_random") is True  # a seeded sandbox's resume: not a clone
    dry = os.environ.get(DRY_RESTORE_ENV) == "1"

    errors: list[str] = []

    timings: dict[str, float] = {}

    def step(name: str, action: Callable[[], object], skip: bool = False) -> bool:
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
    random_reseeded = step("random", lambda: _reseed_python_rngs(seed), keep_random)
    hostname_set = step("hostname", lambda: _set_hostname(hostname), dry)
    return {
        "clock_set": clock_set,
        "rng_reseeded": rng_reseeded,
        "random_reseeded": random_reseeded,
        "hostname_set": hostname_set,
        "seeded": seed is not None and random_reseeded,
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


def _reseed_python_rngs(seed: int | None) -> None:
    # An int seed: a bytes one is first hashed with SHA-512, which a fresh TCG
    # fork pays to translate. The image's eval worker, if one runs, too: sibling
    # forks must not draw the same numbers there either. A sandbox forked with a
    # seed draws from it, and so do the Python processes it starts.
    if seed is not None:
        command.set_seed(seed)
    forkd_eval.reseed_python_rngs(
        int.from_bytes(os.urandom(32), "little") if seed is None else seed
    )
    if IMAGE_EVAL is not None:
        IMAGE_EVAL.reseed(int.from_bytes(os.urandom(32), "little") if seed is None else seed)
    CONTEXTS.reseed(int.from_bytes(os.urandom(32), "little") if seed is None else seed)


def _set_hostname(hostname: str) -> None:
    # Only the kernel's name: /etc/hostname is not rewritten, since the first
    # write to it copies the file up into the overlay and costs ~30 ms of the
    # fork under TCG.
    socket.sethostname(hostname)


OPS: dict[str, Handler] = {
    "ping": op_ping,
    "exec": op_exec,
    "eval": op_eval,
    "eval_interrupt": op_eval_interrupt,
    "eval_peek": op_eval_peek,
    "eval_context_open": op_eval_context_open,
    "eval_context_close": op_eval_context_close,
    "file_read": op_file_read,
    "file_write": op_file_write,
    "file_list": op_file_list,
    "file_remove": op_file_remove,
    "restore": op_restore,
    "configure": op_configure,
    "env_set": op_env_set,
}
