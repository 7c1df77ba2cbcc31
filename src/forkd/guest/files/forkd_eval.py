"""Python eval of the forkd guest agent: one warm interpreter, interruptible, with rich output.

Imported by forkd_agent_handlers.py, which owns the ops (``eval`` and
``eval_interrupt``, see docs/guest-agent.md), and in a container image by
forkd_eval_worker.py in the image's own Python. Standard library only, and
running on Python 3.8 and later: an image may have an old one (no syntax or
call newer than 3.8 outside annotations, which ``annotations`` keeps unevaluated).

Every eval runs on one thread, like a REPL, so objects with thread affinity
(sqlite3 connections, event loops, thread-locals) keep working from one call
to the next. In the agent that thread is the main thread: only the main
thread is woken from a blocking call (``time.sleep``, a socket read) by a
signal, so an interrupt is SIGINT sent to it, and the handler raises only
while an eval runs. A timeout interrupts the same way, with
:class:`EvalTimeout`, which ``except KeyboardInterrupt`` does not catch.

An eval's display outputs (``display(obj)``, a last value with a rich repr,
matplotlib figures left open) come back with its answer.
"""

from __future__ import annotations

import ast
import base64
import builtins
import collections
import contextlib
import io
import json
import linecache
import math
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
import types
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the image's python3 runs this module too: it has no forkd package
    from forkd import agent_wire as wire

MAX_OUTPUT_CHARS = 1024 * 1024  # of stdout, of stderr and of the result's repr
MAX_DISPLAY_BYTES = 8 * 1024 * 1024  # of all display outputs of one eval, as JSON
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 86400.0
# After the timeout, the interrupt repeats this often for this long; then the
# answer goes without the eval, which keeps the interpreter until it ends.
REPEAT_INTERRUPT_S = 0.5
STOP_GRACE_S = 5.0
SOURCES_KEPT = 200  # recent eval sources kept in linecache for tracebacks
TRUNCATED_MARK = "... [truncated]"

# (method, MIME type) from the richest; the first that answers is shown.
RICH_REPRS = (
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
)
BINARY_MIMES = frozenset({"image/png", "image/jpeg"})  # data is base64

# Figures are drawn to PNG: matplotlib must never look for a display. Set
# before user code can import matplotlib; the agent's commands get their own env.
os.environ.setdefault("MPLBACKEND", "Agg")
warnings.filterwarnings("ignore", message=".*non-interactive, and thus cannot be shown")


class EvalTimeout(BaseException):
    """Raised in an eval that runs past its ``timeout_s``.

    Not an Exception nor a KeyboardInterrupt: code that swallows those still stops.
    """


def eval_params(req: dict[str, Any]) -> tuple[str, float]:
    """``code`` and ``timeout_s`` of an eval request (ValueError when invalid)."""
    code = req.get("code")
    if not isinstance(code, str):
        raise ValueError("'code' must be a string")
    timeout = req.get("timeout_s")
    if timeout is None:
        return code, DEFAULT_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError("'timeout_s' must be a number of seconds or null")
    if not (0 < timeout <= MAX_TIMEOUT_S and math.isfinite(timeout)):
        raise ValueError(f"'timeout_s' must be > 0 and at most {MAX_TIMEOUT_S:g}")
    return code, float(timeout)


def reseed_python_rngs(seed: int) -> None:
    """Reseed ``random`` (the module object user code imported too) and, if user code
    loaded it, numpy's global RNG: a fork made unique draws its own numbers."""
    random.seed(seed)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(seed & 0xFFFFFFFF)


# --------------------------------------------------------------------------- output


class CappedText(io.TextIOBase):
    """A text sink that keeps the first ``cap`` characters and flags the rest."""

    def __init__(self, cap: int = MAX_OUTPUT_CHARS) -> None:
        self._parts: list[str] = []
        self._room = cap
        self.truncated = False

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if len(s) > self._room:
            self.truncated = True
        if self._room > 0:
            kept = s[: self._room]
            self._parts.append(kept)
            self._room -= len(kept)
        return len(s)

    def getvalue(self) -> str:
        return "".join(self._parts)

    def since(self, start: int) -> str:
        """What was written from character ``start`` on (read while it is written)."""
        return "".join(list(self._parts))[start:]


def cap_text(text: str, cap: int = MAX_OUTPUT_CHARS) -> str:
    return text if len(text) <= cap else text[:cap] + TRUNCATED_MARK


class Displays:
    """An eval's display outputs as ``{mime, data}``, at most ``cap`` bytes of JSON in all.

    An output that does not fit is dropped (later smaller ones may still
    fit); :meth:`items` then ends with one text/plain marker saying so.
    """

    def __init__(self, cap: int = MAX_DISPLAY_BYTES) -> None:
        self._items: list[wire.DisplayItem] = []
        self._room = cap
        self._cap = cap
        self.dropped = 0
        self._shown_figures: set[int] = set()

    def add(self, mime: str, data: str) -> None:
        size = len(json.dumps({"mime": mime, "data": data}))
        if size > self._room:
            self.dropped += 1
            return
        self._room -= size
        self._items.append({"mime": mime, "data": data})

    def show(self, obj: Any) -> None:
        """Add ``obj`` in its richest form (``display(obj)``)."""
        self.add(*(self._rich(obj) or ("text/plain", cap_text(repr(obj)))))

    def show_if_rich(self, value: Any) -> None:
        """Add an eval's last value if it has a rich form; its repr is the result anyway."""
        if value is not None and (rich := self._rich(value)) is not None:
            self.add(*rich)

    def _rich(self, obj: Any) -> tuple[str, str] | None:
        if _is_figure(obj):  # shown now: not again as an open figure at the end
            self._shown_figures.add(id(obj))
        return rich_repr(obj)

    def add_open_figures(self) -> None:
        """Every matplotlib figure still open, as PNG, then closed (if pyplot is loaded)."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        for number in list(pyplot.get_fignums()):
            figure = pyplot.figure(number)
            try:
                if id(figure) not in self._shown_figures:
                    self.add("image/png", _figure_png(figure))
            except Exception:  # one figure that cannot draw: say why, show the rest
                traceback.print_exc()
            finally:
                pyplot.close(figure)

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def items(self) -> list[wire.DisplayItem]:
        if not self.dropped:
            return list(self._items)
        marker = f"[display truncated: {self.dropped} output(s) dropped past {self._cap} bytes]"
        return [*self._items, {"mime": "text/plain", "data": marker}]


def rich_repr(obj: Any) -> tuple[str, str] | None:
    """``(mime, data)`` of ``obj``'s richest IPython-style repr, or None if it has none.

    A repr method that raises is reported on stderr and the next one is tried.
    """
    if isinstance(obj, type):  # a class: its _repr_*_ are unbound functions
        return None
    if _is_figure(obj):
        return "image/png", _figure_png(obj)
    for method_name, mime in RICH_REPRS:
        method = getattr(obj, method_name, None)
        if not callable(method):
            continue
        try:
            data = method()
        except Exception:
            traceback.print_exc()
            continue
        if isinstance(data, tuple) and data:  # (data, metadata), as IPython allows
            data = data[0]
        if data is None:
            continue
        if mime in BINARY_MIMES and isinstance(data, (bytes, bytearray)):
            return mime, base64.b64encode(data).decode("ascii")
        if isinstance(data, str):
            return mime, data
    return None


def _is_figure(obj: Any) -> bool:
    kind = type(obj)
    return kind.__module__ == "matplotlib.figure" and kind.__name__ == "Figure"


def _figure_png(figure: Any) -> str:
    buf = io.BytesIO()
    figure.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


# --------------------------------------------------------------------------- jobs


class _Job:
    """One eval request: its code, its outputs and where it is in its life."""

    def __init__(self, code: str, timeout_s: float, tag: str | None = None) -> None:
        self.code = code
        self.timeout_s = timeout_s
        self.tag = tag  # who asked: an interrupt with a tag stops this job alone
        self.out, self.err = CappedText(), CappedText()
        self.displays = Displays()
        self.done = threading.Event()
        self.answer: wire.EvalAnswer | None = None
        self.started = False  # the eval thread took it
        self.cancelled = False  # its caller gave up before it started
        self.armed = False  # user code (or its reprs) runs: an interrupt may raise in it
        self.pending: BaseException | None = None  # what the next SIGINT raises

    def answer_now(self, error: str, timed_out: bool) -> wire.EvalAnswer:
        """An answer made while the job is not (or no longer) running its code."""
        return _answer(self, None, error, timed_out)


def _answer(job: _Job, result: str | None, error: str | None, timed_out: bool) -> wire.EvalAnswer:
    return {
        "result": result,
        "error": error,
        "exit_code": 0 if error is None else 1,
        "stdout": job.out.getvalue(),
        "stderr": job.err.getvalue(),
        "stdout_truncated": job.out.truncated,
        "stderr_truncated": job.err.truncated,
        "display": job.displays.items(),
        "display_truncated": job.displays.truncated,
        "timed_out": timed_out,
    }


class EvalRunner:
    """Runs evals one at a time on one thread, in one namespace; interrupts them."""

    def __init__(self, module: types.ModuleType) -> None:
        self.namespace = module.__dict__
        self.namespace.setdefault("__builtins__", builtins)
        self.namespace["display"] = self._display
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._current: _Job | None = None
        self._thread_id: int | None = None  # the eval thread, once claimed
        self._by_signal = False  # interrupts are SIGINT (main thread), else async exceptions
        self._sources: collections.deque[str] = collections.deque()
        self._counter = 0

    # -- the eval thread

    def claim_thread(self) -> None:
        """Make the calling thread the eval thread (before any request can arrive).

        On the main thread, interrupts are SIGINT, which wakes blocking calls;
        elsewhere (the agent loaded as a module, in tests) they are
        asynchronous exceptions, which wait for the next Python bytecode.
        """
        with self._lock:
            if self._thread_id is not None:
                raise RuntimeError("the eval thread is already claimed")
            self._thread_id = threading.get_ident()
            self._by_signal = threading.current_thread() is threading.main_thread()
        if self._by_signal:
            signal.signal(signal.SIGINT, self._on_sigint)

    def serve_forever(self) -> None:
        """Run evals on this thread until :meth:`stop`."""
        if self._thread_id != threading.get_ident():
            self.claim_thread()
        while (job := self._jobs.get()) is not None:
            try:
                self._run_job(job)
            except BaseException as exc:  # an interrupt that landed between evals
                print(f"forkd-eval: {type(exc).__name__} outside an eval", file=sys.__stderr__)

    def stop(self) -> None:
        self._jobs.put(None)

    def _ensure_thread(self) -> None:
        """Start a thread of our own if nobody claimed one (the agent loaded as a module)."""
        with self._lock:
            if self._thread_id is not None:
                return
            ready = threading.Event()
            thread = threading.Thread(target=self._serve_own, args=(ready,), name="eval")
            thread.daemon = True
        thread.start()
        ready.wait()

    def _serve_own(self, ready: threading.Event) -> None:
        with contextlib.suppress(RuntimeError):  # another caller's thread won the race
            self.claim_thread()
            ready.set()
            self.serve_forever()
        ready.set()

    def _run_job(self, job: _Job) -> None:
        with self._lock:
            if job.cancelled:
                return
            job.started = True
            self._current = job
        try:
            job.answer = self._evaluate(job)
        finally:
            with self._lock:
                self._current = None
                job.armed = False
                job.pending = None
                if not self._by_signal:
                    _clear_async_exception(threading.get_ident())
            job.done.set()

    def _evaluate(self, job: _Job) -> wire.EvalAnswer:
        filename = self._remember_source(job.code)
        result: str | None = None
        error: str | None = None
        timed_out = False
        saved_stdin = sys.stdin
        sys.stdin = io.StringIO()  # input() must never read the agent's own stdin
        try:
            with contextlib.redirect_stdout(job.out), contextlib.redirect_stderr(job.err):
                try:
                    job.armed = True
                    try:
                        value = self._run_code(job.code, filename)
                        result = None if value is None else cap_text(repr(value))
                        job.displays.show_if_rich(value)
                        job.displays.add_open_figures()
                    finally:
                        job.armed = False
                except BaseException as exc:  # SystemExit too: the agent must survive
                    timed_out = isinstance(exc, EvalTimeout)
                    error = format_user_error(exc, filename)
        finally:
            sys.stdin = saved_stdin
        return _answer(job, result, error, timed_out)

    def _run_code(self, code: str, filename: str) -> Any:
        """exec the statements; if the last one is an expression, return its value."""
        tree = ast.parse(code, filename, "exec")
        last: ast.Expression | None = None
        if tree.body and isinstance(final := tree.body[-1], ast.Expr):
            tree.body.pop()
            last = ast.Expression(body=final.value)
        exec(compile(tree, filename, "exec"), self.namespace)
        if last is None:
            return None
        return eval(compile(last, filename, "eval"), self.namespace)

    def _remember_source(self, code: str) -> str:
        """Register ``code`` with linecache so tracebacks show the user's lines."""
        self._counter += 1
        filename = f"<forkd-eval-{self._counter}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self._sources.append(filename)
        while len(self._sources) > SOURCES_KEPT:
            linecache.cache.pop(self._sources.popleft(), None)
        return filename

    def _display(self, *objs: Any) -> None:
        """display(obj, ...): show each object in its richest form (as IPython's)."""
        job = self._current
        if job is None or threading.get_ident() != self._thread_id:
            return  # outside an eval, or another thread: nobody would see it
        for obj in objs:
            job.displays.show(obj)

    # -- interrupts

    def _on_sigint(self, signum: int, frame: Any) -> None:
        job = self._current
        if job is None or not job.armed or job.pending is None:
            return  # nothing to interrupt, or a stray SIGINT
        exc, job.pending = job.pending, None
        raise exc

    def _deliver(self, job: _Job, exc: BaseException) -> None:
        """Raise ``exc`` in the running eval (the caller holds the lock)."""
        assert self._thread_id is not None
        job.pending = exc
        if self._by_signal:
            signal.pthread_kill(self._thread_id, signal.SIGINT)
        else:
            _raise_async(self._thread_id, type(exc))

    def interrupt(self, tag: str | None = None) -> bool:
        """KeyboardInterrupt in the running eval (with ``tag``: only when it is the eval
        run with that tag); False if none runs."""
        with self._lock:
            job = self._current
            if job is None or not job.armed or (tag is not None and job.tag != tag):
                return False
            self._deliver(job, KeyboardInterrupt())
            return True

    def peek(self, tag: str, stdout_from: int, stderr_from: int) -> wire.EvalPeekAnswer:
        """What the eval run with ``tag`` printed so far, while it runs."""
        with self._lock:
            job = self._current
        if job is None or job.tag != tag or job.done.is_set():
            return {"running": False, "stdout": "", "stderr": ""}
        return {
            "running": True,
            "stdout": job.out.since(stdout_from),
            "stderr": job.err.since(stderr_from),
        }

    # -- callers

    def run(
        self, code: str, timeout_s: float = DEFAULT_TIMEOUT_S, tag: str | None = None
    ) -> wire.EvalAnswer:
        """Evaluate ``code`` on the eval thread; the answer within ``timeout_s`` plus a grace.

        ``timeout_s`` counts from now: time spent waiting behind another eval
        is included.
        """
        job = _Job(code, timeout_s, tag)
        self._ensure_thread()
        self._jobs.put(job)
        if not job.done.wait(timeout_s):
            return self._stop_late(job)
        return job.answer or job.answer_now("the eval ended without an answer", False)

    def _stop_late(self, job: _Job) -> wire.EvalAnswer:
        """Interrupt a job past its timeout until it stops, for at most STOP_GRACE_S."""
        why = f"the eval ran past its timeout of {job.timeout_s:g} s"
        give_up = time.monotonic() + STOP_GRACE_S
        while True:
            with self._lock:
                if not job.started:
                    job.cancelled = True
                    error = f"EvalTimeout: {why} waiting behind an earlier eval that still runs"
                    return job.answer_now(error, True)
                if job.armed:
                    self._deliver(job, EvalTimeout(why))
            if job.done.wait(REPEAT_INTERRUPT_S):
                return job.answer or job.answer_now(f"EvalTimeout: {why}", True)
            if time.monotonic() >= give_up:
                return job.answer_now(
                    f"EvalTimeout: {why} and did not stop within {STOP_GRACE_S:g} s of "
                    "interrupts; it keeps the interpreter busy until it ends",
                    True,
                )


def format_user_error(exc: BaseException, filename: str) -> str:
    """The traceback from the user's first frame on, without this module's frames
    at its end (an interrupt's signal handler, display's own lines)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    nodes = []
    node = tb
    while node is not None:
        nodes.append(node)
        node = node.tb_next
    kept = len(nodes)
    while kept > 1 and nodes[kept - 1].tb_frame.f_code.co_filename == __file__:
        kept -= 1
    if 0 < kept < len(nodes):
        nodes[kept - 1].tb_next = None
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _raise_async(thread_id: int, exc_type: type[BaseException]) -> None:
    import ctypes  # only off the main thread (tests): the agent itself uses SIGINT

    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type)
    )


def _clear_async_exception(thread_id: int) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
