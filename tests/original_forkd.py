"""The original forkd's clients, as its wire contract describes them (never its code): the
one helper the tests use to speak its agent protocol as its SDK does."""

from __future__ import annotations

import json
import socket
from typing import Any


def original_call(address: str, message: dict[str, Any], wait: float = 35) -> dict[str, Any]:
    """One request as the original SDK sends it to ``address`` (``HOST:PORT``): a
    connection of its own, the JSON and a newline, the write side closed, the answer
    read to EOF."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as sock:
        sock.settimeout(wait)
        sock.sendall(json.dumps(message).encode() + b"\n")
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return dict(json.loads(data))
