"""The guest agent's channel to the host: the byte stream's framing (request lines and
their raw payloads), the threads requests run on, and the port, socket or stdio
the stream comes over.

What a line means is forkd_agent_protocol.py's business. Imported from the
agent's own directory. Standard library only.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import queue
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import forkd_agent_protocol as protocol
from forkd_agent_log import log

from forkd import agent_wire as wire

T = TypeVar("T")

PORT_NAME = "agent"  # name of the virtio-serial port (QEMU: virtserialport,name=agent)
VIRTIO_PORTS_DIR = "/sys/class/virtio-ports"
MAX_LINE_BYTES = 64 * 1024 * 1024  # longest request line accepted; longer ones are dropped
READ_CHUNK_BYTES = 1024 * 1024
DEVICE_REOPEN_DELAY_S = 0.02  # after EOF on the port (no host connected)
DEVICE_RETRY_S = 0.1  # port missing or cannot be opened
# Exists once an agent of this boot announced itself on the port (tmpfs: a boot
# starts without it, a fork keeps the running agent and its mark).
RESTART_MARK = "/run/forkd-agent.started"

# A request, with the raw payload its head announced (None when it announced none).
Request = tuple[bytes, bytearray | None]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            _wait_writable(fd)
            continue
        view = view[written:]


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
MAX_PAYLOAD_BYTES = wire.MAX_CHUNK_BYTES


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

    def feed(self, chunk: bytes) -> Iterator[Request]:
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

    def payload_read(self, n: int) -> Iterator[Request]:
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

    def _take_payload(self, chunk: bytes) -> Generator[Request, None, bytes]:
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

    def _complete(self) -> Iterator[Request]:
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
        parsed = protocol.parse_request(line)
        if parsed is None:
            return
        req_id, req = parsed
        if payload is not None:
            req["data"] = payload  # in place of base64: bytes no JSON line can hold
        with self._idle:
            self._inflight += 1
        if req.get("op") in protocol.INLINE_OPS:
            self._serve_one(req_id, req)
            return
        try:
            WORKERS.submit(lambda: self._serve_one(req_id, req))
        except RuntimeError as exc:  # cannot start a thread: answer inline
            self._finish(req_id, protocol.encode(protocol.error_message(req_id, exc)))

    def _serve_one(self, req_id: int, req: dict[str, Any]) -> None:
        line = protocol.handle_request(req_id, req)
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
        filler = b" " * (protocol.MAX_RAW_BYTES + 1) + b"\n"
        conn.send(filler * 2, 0)  # a cut line, then its raw bytes
    conn.send(protocol.encode({"event": "started", "pid": os.getpid()}), 0)
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
        conn = Connection(fd, functools.partial(os.close, fd))
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
