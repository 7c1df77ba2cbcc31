"""The agent's handle on eval in a container image: a long-lived worker process in the
image's own python3, started at the first eval, restarted after it dies.

In a container image the agent runs in forkd's Python (the runtime disk at
/opt/forkd), which sees none of the image's packages. Eval is the image's
Python, so it runs in ``forkd-eval-worker.py`` started with the python3 (else
python) found on the image's PATH, as the image's user, with its environment
and working directory. Its namespace persists across evals, and a template's
warm-up eval starts it, so every fork inherits it warm with its imports.

Everything the worker sends back is treated as hostile: user code runs in it.
Its answer lines are bounded and checked, a worker that dies answers the evals
in flight with an error saying its state is gone, and the next eval starts a
fresh one. Standard library only (runs in the guest).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import forkd_eval
import forkd_eval_worker  # the pipes' framing
import forkd_exec

from forkd import agent_wire as wire

RUNTIME_PREFIX = "/opt/forkd/rt"  # forkd's own Python, on the runtime disk
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkd-eval-worker.py")
JS_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkd-js-worker.js")
PYTHON_NAMES = ("python3", "python")
MIN_PYTHON = "3.8"  # as forkd-eval-worker.py's MIN_PYTHON
CONTROL_WAIT_S = 5.0  # for an interrupt's or a reseed's answer
# Past an eval's timeout and forkd_eval's own grace of interrupts, how long more the
# worker's start and answer are waited for (its interpreter may be held by C code).
# The host waits 2 s more than that (forkd.vmm.agent.ops.eval_wait_secs): the agent
# answers first, saying why.
ANSWER_GRACE_S = 8.0
# For the worker's ready line: at most this, and never past the eval's own deadline.
START_TIMEOUT_S = 60.0
MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a longer line from the worker is dropped
STDERR_TAIL_BYTES = 4096  # of the worker's stderr, quoted when it exits
READ_CHUNK_BYTES = 1024 * 1024


class NoImagePython(Exception):
    """The image has no python3 (nor python) on its PATH: eval cannot run there."""


class ImagePythonUnsupported(Exception):
    """The image's Python is older than forkd_eval supports, or does not start."""


def in_runtime(prefix: str = sys.prefix) -> bool:
    """Whether this agent runs from forkd's runtime disk (so in a container image)."""
    return prefix == RUNTIME_PREFIX or prefix.startswith(RUNTIME_PREFIX + "/")


@dataclass(frozen=True)
class Program:
    """What a worker runs in: the executables looked for on the image's PATH, the script
    they run, and how an eval of it is interrupted (a request, else SIGINT)."""

    label: str
    names: tuple[str, ...]
    script: str
    interrupt_by_signal: bool = False


PYTHON = Program("Python", PYTHON_NAMES, WORKER_SCRIPT)
# JavaScript (E2B's code interpreter contexts), where the image has Node.js.
NODE = Program("Node.js", ("node", "nodejs"), JS_WORKER_SCRIPT, interrupt_by_signal=True)


def find_python(path_env: str, names: tuple[str, ...] = PYTHON_NAMES) -> str | None:
    """The image's python3, else python (or the first of ``names``), on ``path_env``
    (absolute entries only, never forkd's own under /opt/forkd)."""
    dirs = [d for d in path_env.split(":") if d.startswith("/")]
    for name in names:
        for directory in dirs:
            candidate = os.path.join(directory, name)
            if candidate.startswith("/opt/forkd/"):
                continue
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    return None


@dataclass(frozen=True)
class Launch:
    """How the worker is started: the image's environment, directory and user."""

    env: dict[str, str]
    cwd: str | None
    identity: Any  # a forkd_identity.Identity


def failed_answer(error: str, timed_out: bool = False) -> wire.EvalAnswer:
    """An eval's answer when the worker gave none."""
    return {
        "result": None,
        "error": error,
        "exit_code": 1,
        "stdout": "",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "display": [],
        "display_truncated": False,
        "timed_out": timed_out,
    }


_TEXT_CAP = forkd_eval.MAX_OUTPUT_CHARS + len(forkd_eval.TRUNCATED_MARK)


def _text_or_none(result: dict[str, Any], name: str) -> str | None:
    value = result.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name!r} is not a string")
    return value if value is None else value[:_TEXT_CAP]


def _stream(result: dict[str, Any], name: str) -> str:
    value = result.get(name, "")
    if not isinstance(value, str):
        raise ValueError(f"{name!r} is not a string")
    return value


def checked_answer(result: Any) -> wire.EvalAnswer:
    """The worker's eval answer with the fields and types the host expects, capped as
    forkd_eval caps them (ValueError if it is not an answer)."""
    if not isinstance(result, dict):
        raise ValueError("not an object")
    answer = failed_answer("")
    answer["result"] = _text_or_none(result, "result")
    answer["error"] = _text_or_none(result, "error")
    stdout, stderr = _stream(result, "stdout"), _stream(result, "stderr")
    cap = forkd_eval.MAX_OUTPUT_CHARS
    answer["stdout"], answer["stderr"] = stdout[:cap], stderr[:cap]
    answer["stdout_truncated"] = len(stdout) > cap or result.get("stdout_truncated") is True
    answer["stderr_truncated"] = len(stderr) > cap or result.get("stderr_truncated") is True
    answer["timed_out"] = result.get("timed_out") is True
    display = result.get("display", [])
    if not isinstance(display, list):
        raise ValueError("'display' is not a list")
    kept = forkd_eval.Displays()
    for item in display:
        if not (
            isinstance(item, dict) and all(isinstance(item.get(k), str) for k in ("mime", "data"))
        ):
            raise ValueError("a display item is not {mime, data}")
        kept.add(item["mime"], item["data"])
    answer["display"] = kept.items()
    answer["display_truncated"] = result.get("display_truncated") is True or kept.truncated
    answer["exit_code"] = 0 if answer["error"] is None else 1
    return answer


class _Pending:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.message: dict[str, Any] | None = None  # None once done: the worker died


class _Worker:
    """One running worker process: its pipes, its requests in flight, its end."""

    def __init__(self, python: str, launch: Launch, script: str = WORKER_SCRIPT) -> None:
        self.python = python
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stderr_tail = b""
        self._stderr_ended = threading.Event()
        self.gone: str | None = None  # why the worker is no more, once it is not
        self.hello = _Pending()
        try:
            self.proc = subprocess.Popen(
                [python, script],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=launch.cwd,
                env=launch.env,
                start_new_session=True,
                **forkd_exec.as_user(launch.identity),
            )
        except OSError as exc:
            raise ImagePythonUnsupported(f"the image's {python} could not start: {exc}") from None
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        for target, name in (
            (self._read_answers, "eval-answers"),
            (self._drain_stderr, "eval-stderr"),
        ):
            thread = threading.Thread(target=target, name=name)
            thread.daemon = True
            thread.start()

    # -- starting

    def wait_ready(self, wait_s: float) -> None:
        """Wait for the worker's first line; the reason as an exception if it is no ready."""
        if not self.hello.done.wait(wait_s):
            self.kill()
            raise ImagePythonUnsupported(
                f"the image's {self.python} did not start forkd's eval worker within {wait_s:.0f} s"
            )
        hello = self.hello.message
        if hello is None:
            self.proc.wait()
            raise ImagePythonUnsupported(
                f"the image's {self.python} exited at start ({self._status()}){self._tail()}"
            )
        if hello.get("ready") is True:
            return
        self.kill()
        version = str(hello.get("python"))[:40]
        if hello.get("error") == "python_too_old":
            raise ImagePythonUnsupported(
                f"this sandbox's image has Python {version} ({self.python}); eval needs Python "
                f"{MIN_PYTHON} or later in the image: use exec"
            )
        raise ImagePythonUnsupported(f"the image's {self.python} answered no ready line")

    # -- requests

    def call(self, message: dict[str, Any], wait_s: float) -> dict[str, Any] | None:
        """The worker's answer to ``message``; None if it died first or took too long
        (then :attr:`gone` says whether it died)."""
        pending = _Pending()
        with self._lock:
            if self.gone is not None:
                return None
            req_id = next(self._ids)
            self._pending[req_id] = pending
        data = forkd_eval_worker.encode({**message, "id": req_id})
        try:
            with self._write_lock:
                assert self.proc.stdin is not None
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
        except (OSError, ValueError):  # the worker closed its end: it is exiting
            pending.done.wait(CONTROL_WAIT_S)
        else:
            pending.done.wait(wait_s)
        with self._lock:
            self._pending.pop(req_id, None)
        return pending.message

    def _read_answers(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(OSError):
            for line in forkd_eval_worker.read_lines(self.proc.stdout.fileno(), MAX_ANSWER_BYTES):
                self._take(line)
        self._ended()

    def _take(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return  # not the worker's: user code wrote to the pipe
        if not isinstance(message, dict):
            return
        if not self.hello.done.is_set():
            self.hello.message = message
            self.hello.done.set()
            return
        req_id = message.get("id")
        with self._lock:
            pending = self._pending.get(req_id) if isinstance(req_id, int) else None
        if pending is not None and not pending.done.is_set():
            pending.message = message
            pending.done.set()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, READ_CHUNK_BYTES):
                self._stderr_tail = (self._stderr_tail + chunk)[-STDERR_TAIL_BYTES:]
        self._stderr_ended.set()

    def _ended(self) -> None:
        """The worker closed its answers: it is exiting (or user code closed the pipe,
        and it is ended). Answer everything in flight."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(1.0)
        status = self._status() if self.proc.returncode is not None else "closed its pipe"
        if self.proc.returncode is None:
            self.kill()
        with self._lock:
            self.gone = status
            waiting = list(self._pending.values())
        for pending in (self.hello, *waiting):
            pending.done.set()

    def _status(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
            return f"killed by signal {-code}"
        return f"exit status {code}"

    def _tail(self) -> str:
        """The end of the worker's stderr (once it is closed, or a second has passed:
        a child of user code may hold it open)."""
        self._stderr_ended.wait(1.0)
        text = self._stderr_tail.decode("utf-8", errors="replace").strip()
        return f":\n{text}" if text else ""

    def death_notice(self) -> str:
        return (
            f"the image's Python ({self.python}) exited during this eval ({self.gone}): its "
            f"state (variables, imports) is gone; the next eval starts a fresh one{self._tail()}"
        )

    def signal_eval(self, signum: int) -> bool:
        """Send ``signum`` to the worker while an eval of it runs; whether one did."""
        with self._lock:
            busy = bool(self._pending)
        if busy:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signum)
        return busy

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(CONTROL_WAIT_S)


class ImagePython:
    """Evals in the image's python3: forkd_eval.EvalRunner's run and interrupt, in a worker."""

    def __init__(self, launch: Callable[[], Launch], program: Program = PYTHON) -> None:
        self._launch = launch
        self.program = program
        self._start_lock = threading.Lock()
        self._worker: _Worker | None = None

    def _running(self) -> _Worker | None:
        worker = self._worker
        return worker if worker is not None and worker.gone is None else None

    def _ensure(self, deadline: float) -> _Worker:
        with self._start_lock:
            worker = self._running()
            if worker is not None:
                return worker
            launch = self._launch()
            program = self.program
            python = find_python(launch.env.get("PATH", ""), program.names)
            if python is None:
                raise NoImagePython(
                    f"this sandbox's image has no {program.names[0]} on its PATH "
                    f"({launch.env.get('PATH', '')[:300]}): eval runs {program.label} in the "
                    "image; use exec"
                )
            worker = _Worker(python, launch, program.script)
            worker.wait_ready(min(START_TIMEOUT_S, max(1.0, deadline - time.monotonic())))
            self._worker = worker
            return worker

    def run(self, code: str, timeout_s: float, tag: str | None = None) -> wire.EvalAnswer:
        """forkd_eval's answer to ``code``, from the worker (started if none runs)."""
        deadline = time.monotonic() + timeout_s + forkd_eval.STOP_GRACE_S + ANSWER_GRACE_S
        worker = self._ensure(deadline)
        wait_s = max(0.0, deadline - time.monotonic())
        request = {"op": "eval", "code": code, "timeout_s": timeout_s, "tag": tag}
        message = worker.call(request, wait_s)
        if message is None:
            if worker.gone is not None:
                return failed_answer(worker.death_notice())
            return failed_answer(
                f"EvalTimeout: the eval ran past its timeout of {timeout_s:g} s and the "
                f"image's Python gave no answer {forkd_eval.STOP_GRACE_S + ANSWER_GRACE_S:g} s "
                "later; it keeps that interpreter busy until it ends",
                timed_out=True,
            )
        if message.get("ok") is not True:
            error = str(message.get("error"))[:2000]
            if message.get("ok") is False:
                raise ValueError(error)  # the worker refused the request itself
            return failed_answer(f"the image's Python gave a malformed answer: {error}")
        try:
            return checked_answer(message.get("result"))
        except ValueError as exc:
            return failed_answer(f"the image's Python gave a malformed answer: {exc}")

    def interrupt(self, tag: str | None = None) -> bool:
        """KeyboardInterrupt in the running eval (with ``tag``: only the eval run with
        it); False if none runs (or no worker)."""
        worker = self._running()
        if worker is None:
            return False
        if self.program.interrupt_by_signal:  # its evals hold the thread that reads requests
            return worker.signal_eval(signal.SIGINT)
        message = worker.call({"op": "interrupt", "tag": tag}, CONTROL_WAIT_S)
        result = message.get("result") if message else None
        return isinstance(result, dict) and result.get("interrupted") is True

    def reseed(self, seed: int) -> None:
        """Reseed the worker's RNGs (a fork made unique); nothing to do without one. A
        Node.js worker reseeds from the kernel's RNG on SIGUSR2 (never waited for: its
        one thread may be running an eval)."""
        worker = self._running()
        if worker is None:
            return
        if self.program.interrupt_by_signal:
            with contextlib.suppress(OSError):
                os.kill(worker.proc.pid, signal.SIGUSR2)
            return
        started = time.monotonic()
        message = worker.call({"op": "reseed", "seed": seed}, CONTROL_WAIT_S)
        if message is None or message.get("ok") is not True:
            if worker.gone is not None:
                return  # no state left to share with a sibling
            raise RuntimeError(
                f"the image's Python did not reseed within {time.monotonic() - started:.1f} s"
            )

    def stop(self) -> None:
        """End the worker (its state with it)."""
        with self._start_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()
