"""The original forkd agent's protocol, served on TCP port 8888, which the host
reaches at a sandbox's guest_addr: one JSON request per connection (``ping``,
``exec``, ``eval``), one JSON answer, then close.

Every limit below keeps a client that is slow, silent, huge or numerous from
holding the agent: the virtio-serial channel never waits on it. The ops are the
channel's own handlers (forkd_agent_handlers.py), in the original's words.
Imported from the agent's own directory. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from forkd_agent_handlers import op_eval, op_eval_interrupt, op_exec, op_ping
from forkd_agent_log import log
from forkd_agent_params import DEFAULT_EXEC_TIMEOUT_S, RequestError
from forkd_agent_protocol import encode

from forkd import agent_wire as wire

TCP_HOST = "0.0.0.0"
TCP_PORT = 8888
TCP_MAX_REQUEST_BYTES = 1024 * 1024  # longer requests get an error answer
TCP_READ_TIMEOUT_S = 5.0  # the whole request must arrive within this
TCP_WRITE_TIMEOUT_S = 30.0  # the client must take the whole answer within this
TCP_MAX_CONNECTIONS = 16  # served at once; more are closed at once
TCP_BACKLOG = 64
TCP_DRAIN_S = 0.5  # after answering: how long to read and drop what the client still sends
TCP_BIND_RETRY_S = 1.0
READ_CHUNK_BYTES = 1024 * 1024
MAX_EXEC_TIMEOUT_S = 86400.0  # as the HTTP API's (forkd.limits.MAX_EXEC_TIMEOUT_SECS)
PROBE_GAP_S = 0.05  # between the two blanks that ask whether an eval's client is still there
PROBE_EVERY_S = 1.0  # how often a waiting eval's connection is asked that


def _tcp_exec(req: dict[str, Any]) -> wire.ExecAnswer:
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
    ``traceback``. Its ``timeout`` (the original SDK's word; ``timeout_s`` or
    ``timeout_secs`` too) interrupts the code then."""
    given = {k: req[k] for k in ("timeout_s", "timeout_secs", "timeout") if req.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise RequestError("'timeout' and 'timeout_s' differ: give one of them")
    timeout = next(iter(given.values()), None)
    if timeout is not None and not isinstance(timeout, bool) and isinstance(timeout, int | float):
        timeout = min(float(timeout), MAX_EXEC_TIMEOUT_S)
    evaluated = op_eval({"code": req.get("code"), "timeout_s": timeout, "tag": req.get("tag")})
    answer: dict[str, Any] = dict(evaluated)
    error = evaluated.get("error")
    if error:
        lines = [line for line in error.splitlines() if line.strip()]
        answer["traceback"] = error
        answer["error"] = lines[-1].strip() if lines else error
    return answer


def client_gone(conn: socket.socket) -> bool:
    """Whether the client of ``conn`` closed its socket (it may have closed only its
    sending side: the original SDK does, then waits). Two blanks are sent, which JSON
    ignores before the answer: a closed socket answers the first with a reset, and the
    second fails. Only the connection's own thread asks, before it answers."""
    try:
        conn.send(b" ", socket.MSG_DONTWAIT)
        time.sleep(PROBE_GAP_S)
        conn.send(b" ", socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False  # its buffer is full: it is there, just not reading yet
    except OSError:
        return True
    return False


TCP_ACTIONS: dict[str, Callable[[dict[str, Any]], Mapping[str, object]]] = {
    "ping": op_ping,
    "exec": _tcp_exec,
    "eval": _tcp_eval,  # the same warm interpreter as the virtio-serial channel's
}


def _tcp_error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def handle_tcp_request(data: bytes, tag: str | None = None) -> dict[str, Any]:
    """The answer to one TCP request (the bytes before its newline); an eval runs with
    ``tag``, which an interrupt of that eval alone names (a client's own is dropped)."""
    if not data.strip():
        return _tcp_error("empty request: send one JSON object and a newline")
    try:
        req = json.loads(data)
    except ValueError:  # includes UnicodeDecodeError
        return _tcp_error("the request is not JSON")
    if not isinstance(req, dict):
        return _tcp_error("the request must be a JSON object")
    req.pop("tag", None)
    if tag is not None:
        req["tag"] = tag
    action = req.get("action")
    handler = TCP_ACTIONS.get(action) if isinstance(action, str) else None
    if handler is None:
        return _tcp_error(f"unknown action: {action!r} (expected one of {', '.join(TCP_ACTIONS)})")
    try:
        answer = handler(req)
        # The original forkd client takes an 'error' key, even a null one, as a failure.
        kept = {k: v for k, v in answer.items() if not (k == "error" and v is None)}
        return {"ok": True, **kept}
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
        host, port = sock.getsockname()[:2]
        return str(host), int(port)

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
                if problem:
                    answer = _tcp_error(problem)
                elif _is_eval(data):
                    answer = self._eval_watching(conn, data)
                else:
                    answer = handle_tcp_request(data)
                self._answer(conn, answer)
        except ConnectionError:
            pass  # the client reset or left: its own business
        except OSError as exc:
            log(f"tcp connection: {exc}")
        finally:
            self._slots.release()

    def _eval_watching(self, conn: socket.socket, data: bytes) -> dict[str, Any]:
        """The eval of ``data``, run on a thread of its own while this connection's thread
        watches its client: one that closed its socket (it gave up waiting) has that
        eval, and no other, interrupted, so the one interpreter is free for the next."""
        tag = secrets.token_hex(8)
        answer: list[dict[str, Any]] = []
        done = threading.Event()

        def run() -> None:
            try:
                answer.append(handle_tcp_request(data, tag))
            finally:
                done.set()

        threading.Thread(target=run, name="tcp-eval", daemon=True).start()
        gone = False
        while not done.wait(PROBE_EVERY_S):
            if gone or client_gone(conn):
                if not gone:
                    log("tcp eval: its client left; interrupting it")
                gone = True
                op_eval_interrupt({"tag": tag})  # again until it runs, if it waits its turn
        return answer[0] if answer else _tcp_error("the eval ended without an answer")

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
        view = memoryview(encode(answer))
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


def _is_eval(data: bytes) -> bool:
    """Whether a request asks for an eval (cheaply: the whole parse comes after)."""
    if b"eval" not in data:
        return False
    with contextlib.suppress(ValueError):
        req = json.loads(data)
        return isinstance(req, dict) and req.get("action") == "eval"
    return False


def _refuse(conn: socket.socket, message: str) -> None:
    """Close at once, without waiting for anything; say why if the socket takes it.

    A request that already arrived is read and dropped first (up to one
    chunk): closing with unread data would reset the connection and lose
    the reason."""
    with conn, contextlib.suppress(OSError):
        conn.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            conn.recv(READ_CHUNK_BYTES)
        conn.send(encode(_tcp_error(message)))
        conn.shutdown(socket.SHUT_WR)


def tcp_address(text: str) -> tuple[str, int] | None:
    """``[HOST:]PORT`` for --tcp, or None for ``off``."""
    if text == "off":
        return None
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--tcp: expected [HOST:]PORT or 'off', got {text!r}")
    return host or TCP_HOST, int(port)
