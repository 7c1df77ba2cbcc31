"""A small web service for a guest (standard library only): HTTP and a WebSocket echo.

Run in a guest as ``python3 guest_web.py PORT NAME``; unit tests run
:func:`serve` in a thread on loopback. Routes:

- ``GET /`` (any path not below): ``hello from NAME`` and the path asked;
- ``GET /headers``: the request's headers as JSON;
- ``POST /echo``: the body back, with its length in ``X-Received``;
- ``GET /drip?n=N``: N lines, one every 0.05 s, chunked;
- ``GET /ws``: a WebSocket that echoes each message (text or binary);
- ``GET /raw``: for the tunnel tests, anything that is not HTTP is echoed
  by the TCP echo service :func:`serve_tcp_echo` instead.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_name_text = "guest"

    def log_message(self, *args: object) -> None:
        pass

    def _send(
        self,
        status: int,
        body: bytes,
        ctype: str = "text/plain",
        extra: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            self._websocket()
        elif url.path == "/headers":
            body = json.dumps([[k.lower(), v] for k, v in self.headers.items()]).encode()
            self._send(200, body, "application/json")
        elif url.path == "/cookies":  # a page setting cookies for the whole host
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.send_header("Set-Cookie", "session=abc; Path=/; Domain=127.0.0.1; HttpOnly")
            self.send_header("Set-Cookie", "theme=dark; Max-Age=60; SameSite=Lax")
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header(
                "Report-To",
                '{"group":"g","max_age":86400,"endpoints":[{"url":"https://127.0.0.1:9/"}]}',
            )
            self.send_header("NEL", '{"report_to":"g","max_age":86400,"success_fraction":1}')
            self.send_header("Alt-Svc", 'h3=":443"; ma=86400')
            self.send_header("Strict-Transport-Security", "max-age=31536000")
            self.end_headers()
        elif url.path == "/opener":  # a page that opens the console and reaches into it
            # Until the console has loaded in the window, or the window is cut off (a look the
            # browser refuses while it moves the window away is neither: it looks again).
            page = (
                b"<!doctype html><title>opening</title><script>"
                b"const w = window.open('/ui/');"
                b"const look = setInterval(() => {"
                b" if (!w) { document.title = 'blocked'; clearInterval(look); return; }"
                b" if (w.closed) { document.title = 'cut off'; clearInterval(look); return; }"
                b" let seen = '';"
                b" try { seen = w.document.title; }"
                b" catch (e) { return; }"  # mid-swap the window may refuse a look: look again
                b" if (seen) { document.title = 'reached:' + seen; clearInterval(look); }"
                b"}, 100);"
                b"</script>"
            )
            self._send(200, page, "text/html", extra={"Cross-Origin-Opener-Policy": "same-origin"})
        elif url.path == "/drip":
            n = int(parse_qs(url.query).get("n", ["5"])[0])
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(n):
                line = f"line {i}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n")
        else:
            name = self.server.name  # type: ignore[attr-defined]
            self._send(
                200,
                f"hello from {name} at {self.path}\n".encode(),
                extra={
                    "Keep-Alive": "timeout=5",
                    "Connection": "keep-alive, X-Private",
                    "X-Private": "hop",
                    # reaching past its prefix on a shared browser origin
                    "Service-Worker-Allowed": "/",
                    "Clear-Site-Data": '"*"',
                },
            )

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        if length is not None:
            body = self.rfile.read(int(length))
        else:  # chunked
            parts = []
            while True:
                size = int(self.rfile.readline().strip(), 16)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
                if size == 0:
                    break
            body = b"".join(parts)
        self._send(200, body, "application/octet-stream", {"X-Received": str(len(body))})

    def _websocket(self) -> None:
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        offered = self.headers.get("Sec-WebSocket-Protocol")
        if offered:
            self.send_header("Sec-WebSocket-Protocol", offered.split(",")[0].strip())
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            frame = _read_frame(self.rfile)
            if frame is None:
                return
            opcode, payload = frame
            if opcode == 8:  # close: answer it and stop
                _write_frame(self.wfile, 8, payload[:2])
                return
            if opcode == 9:  # ping
                _write_frame(self.wfile, 10, payload)
            elif opcode in (1, 2):
                _write_frame(self.wfile, opcode, payload)


def _read_frame(rfile: object) -> tuple[int, bytes] | None:
    head = rfile.read(2)  # type: ignore[attr-defined]
    if len(head) < 2:
        return None
    opcode, length = head[0] & 0x0F, head[1] & 0x7F
    if length == 126:
        length = struct.unpack("!H", rfile.read(2))[0]  # type: ignore[attr-defined]
    elif length == 127:
        length = struct.unpack("!Q", rfile.read(8))[0]  # type: ignore[attr-defined]
    mask = rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"  # type: ignore[attr-defined]
    data = rfile.read(length)  # type: ignore[attr-defined]
    return opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _write_frame(wfile: object, opcode: int, payload: bytes) -> None:
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    wfile.write(head + payload)  # type: ignore[attr-defined]
    wfile.flush()  # type: ignore[attr-defined]


def make_server(host: str, port: int, name: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.name = name  # type: ignore[attr-defined]
    return server


def serve_tcp_echo(host: str, port: int) -> socket.socket:
    """A TCP echo service in threads; returns its listening socket (close it to stop)."""
    listener = socket.create_server((host, port))

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener


if __name__ == "__main__":
    make_server("0.0.0.0", int(sys.argv[1]), sys.argv[2]).serve_forever()
