"""The audit log: one bounded JSON line per API request, in files rotated by size.

Whatever clients send, the log stays bounded and the daemon keeps answering:

- every text field is cut to ``AUDIT_FIELD_LIMIT`` characters (paths and
  addresses come from the client);
- 401s are recorded at most ``AUDIT_401_PER_SEC`` a second per client address
  (``AUDIT_401_CLIENTS`` addresses a second; the rest share one allowance);
  the rest of that second is one line, ``"M more 401s suppressed"``, written
  with the next record (or at shutdown);
- ``audit.log`` is renamed ``audit.log.1`` when the next line would take it
  past ``max_bytes``; ``files`` renamed files are kept, the oldest dropped;
- a line that cannot be written (full disk, I/O error, closed file) is lost
  and counted, and the daemon log says so at most once a minute. Writing
  never raises: the request's answer is the same with or without the log.

The token is never passed here. Operators may set ``FORKD_AUDIT_LOG_MAX_MIB``
and ``FORKD_AUDIT_LOG_FILES`` (docs/RUNBOOK.md).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from forkd.limits import (
    AUDIT_401_CLIENTS,
    AUDIT_401_PER_SEC,
    AUDIT_FIELD_LIMIT,
    AUDIT_LOG_FILES,
    AUDIT_LOG_MAX_BYTES,
    AUDIT_WARN_INTERVAL_SECS,
)

log = logging.getLogger(__name__)

Fields = dict[str, Any]

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
_OTHERS = "other addresses"


def bounded(value: Any, limit: int = AUDIT_FIELD_LIMIT) -> Any:
    """``value``, or its first ``limit`` characters and how many were cut."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}...(+{len(value) - limit} chars)"
    return value


class Throttle:
    """At most ``per_sec`` records a second per key; counts the rest, for one summary
    line per key once that second is over. Past ``max_keys`` keys in one second, the
    rest share one allowance (addresses are cheap to vary: IPv6, X-Forwarded-For
    from loopback)."""

    def __init__(self, per_sec: int, max_keys: int | None = None) -> None:
        self.per_sec = per_sec
        self.max_keys = max_keys
        self.second = 0
        self.admitted: dict[str, int] = {}
        self.suppressed: dict[str, int] = {}

    def admit(self, key: str, second: int) -> bool:
        if second != self.second:
            self.second = second
            self.admitted.clear()
        if (
            self.max_keys is not None
            and key not in self.admitted
            and len(self.admitted) >= self.max_keys
        ):
            key = _OTHERS
        seen = self.admitted.get(key, 0)
        self.admitted[key] = seen + 1
        if seen < self.per_sec:
            return True
        self.suppressed[key] = self.suppressed.get(key, 0) + 1
        return False

    def summaries(self, second: int | None) -> list[tuple[str, int]]:
        """(key, records suppressed) for a second before ``second`` (None: all of
        them, at shutdown); each is given once."""
        if not self.suppressed or (second is not None and second == self.second):
            return []
        found = list(self.suppressed.items())
        self.suppressed.clear()
        return found


def _denials(suppressed: list[tuple[str, int]]) -> list[Fields]:
    return [
        {"status": 401, "client": client, "suppressed": n, "message": f"{n} more 401s suppressed"}
        for client, n in suppressed
    ]


class AuditLog:
    """``<state-dir>/audit.log``, opened for the daemon's life; see the module docstring."""

    def __init__(self, path: Path, max_bytes: int | None = None, files: int | None = None) -> None:
        self.path = path
        env_bytes = _env_int("FORKD_AUDIT_LOG_MAX_MIB", 1 << 20)
        self.max_bytes = max_bytes or env_bytes or AUDIT_LOG_MAX_BYTES
        self.files = files or _env_int("FORKD_AUDIT_LOG_FILES", 1) or AUDIT_LOG_FILES
        self.lost = 0  # lines that could not be written, since start
        self._lost_unreported = 0
        self._warned_at: float | None = None  # monotonic time of the last warning
        self._lock = threading.Lock()
        self._throttle = Throttle(AUDIT_401_PER_SEC, AUDIT_401_CLIENTS)
        self._fd: int | None = None
        self._size = 0
        self._torn = False  # a short write left a partial line
        self._closed = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._note_lost(exc, 0)
        self._open()

    # ------------------------------------------------------------ writing

    def write(self, **fields: Any) -> None:
        """Append one record; never raises."""
        try:
            with self._lock:
                second = int(time.monotonic())
                records = _denials(self._throttle.summaries(second))
                if fields.get("status") != 401 or self._throttle.admit(
                    str(fields.get("client")), second
                ):
                    records.append(fields)
                if records:
                    self._append(records)
        except Exception as exc:  # a bug here must not become the request's 500
            self._note_lost(exc, 1)

    def close(self) -> None:
        with self._lock:
            try:
                records = _denials(self._throttle.summaries(None))
                if records:
                    self._append(records)
            finally:
                self._closed = True
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None

    def _append(self, records: list[Fields]) -> None:
        now = round(time.time(), 3)
        data = b"".join(
            json.dumps(
                {"time": now, **{k: bounded(v) for k, v in r.items()}},
                separators=(",", ":"),
                default=str,
            ).encode()
            + b"\n"
            for r in records
        )
        if self._torn:
            data = b"\n" + data
        if self._fd is None and not self._closed:
            self._open()
        if self._fd is not None and self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        if self._fd is None:
            self._note_lost(OSError("the audit log is not open"), len(records))
            return
        try:
            written = os.write(self._fd, data)
        except OSError as exc:
            self._note_lost(exc, len(records))
            return
        self._size += written
        self._torn = written < len(data)
        if self._torn:
            self._note_lost(OSError(f"short write: {written} of {len(data)} bytes"), 1)

    # ------------------------------------------------------------ files

    def _open(self) -> None:
        try:
            self._fd = os.open(self.path, _OPEN_FLAGS, 0o600)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            self._fd = None
            self._note_lost(exc, 0)

    def _rotate(self) -> None:
        """audit.log.N-1 → .N, ..., audit.log → .1, and a fresh audit.log.

        On failure the old file is closed and the lines are lost until a
        rotation works: better than a log that outgrows its bound.
        """
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        try:
            for n in range(self.files - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{n}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        except OSError as exc:
            self._note_lost(exc, 0)
            return
        self._torn = False
        self._open()

    def _note_lost(self, exc: BaseException, records: int) -> None:
        """Count lost lines; say so in the daemon log at most once in a while."""
        self.lost += records
        self._lost_unreported += records
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < AUDIT_WARN_INTERVAL_SECS:
            return
        self._warned_at = now
        log.warning(
            "audit log %s: cannot write (%s: %s); %d lines lost since the last warning, "
            "%d since start; next warning in %.0f s at the earliest",
            self.path,
            type(exc).__name__,
            exc,
            self._lost_unreported,
            self.lost,
            AUDIT_WARN_INTERVAL_SECS,
        )
        self._lost_unreported = 0


def _env_int(name: str, unit: int) -> int | None:
    """``$name`` times ``unit``, or None (unset or unreadable: the default holds)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        log.warning("ignoring %s=%r: want a whole number of at least 1", name, text)
        return None
    return int(text) * unit
