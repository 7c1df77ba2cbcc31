"""Append-only JSON-lines audit log: one line per API request, never the token."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class AuditLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def write(self, **fields: Any) -> None:
        record = {"time": round(time.time(), 3), **fields}
        line = json.dumps(record, separators=(",", ":"), default=str).encode() + b"\n"
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)
