"""What the egress proxy did with each connection (and each HTTP request): a bounded
ring per sandbox, and a callback for events and metrics."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

RING_SIZE = 1000  # records kept per sandbox; older ones are dropped
MAX_RINGS = 256  # sandboxes whose records are kept (killed ones too); the oldest go first

_ids = itertools.count(1)


@dataclass
class EgressRecord:
    sandbox_id: str
    verdict: str  # "allowed" | "refused"
    kind: str  # "tls" | "http" | "tcp"
    host: str | None  # the name the guest gave (SNI, Host), canonical; None: an address
    port: int
    address: str | None = None  # where the proxy connected (or would have)
    reason: str | None = None  # why it was refused, or what ended it
    method: str | None = None  # HTTP: the method and the path without its query
    path: str | None = None
    secrets: list[str] = field(default_factory=list)  # names substituted (never values)
    bytes_out: int = 0  # guest -> outside
    bytes_in: int = 0
    time: float = field(default_factory=time.time)
    ended_at: float | None = None  # None: the connection is still open
    id: int = field(default_factory=lambda: next(_ids))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EgressCounts:
    """What one sandbox's guest did through the proxy since the daemon started."""

    allowed: int = 0
    refused: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    substitutions: int = 0  # requests a secret was put in


class EgressLog:
    """Per sandbox, the newest :data:`RING_SIZE` records in the order their connections
    (or requests) began; ``notify`` sees each as it ends."""

    def __init__(self, notify: Callable[[EgressRecord], None] | None = None) -> None:
        self.notify = notify
        self._rings: dict[str, collections.deque[EgressRecord]] = {}
        self.counts: dict[str, EgressCounts] = {}

    def begin(self, record: EgressRecord) -> EgressRecord:
        """Keep ``record`` now (a connection under way shows, its bytes still counting)."""
        ring = self._rings.get(record.sandbox_id)
        if ring is None:
            while len(self._rings) >= MAX_RINGS:
                self.forget(next(iter(self._rings)))
            ring = self._rings[record.sandbox_id] = collections.deque(maxlen=RING_SIZE)
        ring.append(record)
        return record

    def end(self, record: EgressRecord) -> None:
        record.ended_at = time.time()
        counts = self.counts.setdefault(record.sandbox_id, EgressCounts())
        if record.verdict == "allowed":
            counts.allowed += 1
        else:
            counts.refused += 1
        counts.bytes_out += record.bytes_out
        counts.bytes_in += record.bytes_in
        counts.substitutions += bool(record.secrets)
        if self.notify is not None:
            self.notify(record)

    def add(self, record: EgressRecord) -> None:
        """A record begun and ended at once (a refusal)."""
        self.end(self.begin(record))

    def of(self, sandbox_id: str, after: int = 0, limit: int = 100) -> list[EgressRecord]:
        """The records of ``sandbox_id`` newer than id ``after``, oldest first."""
        ring = self._rings.get(sandbox_id, ())
        return [r for r in ring if r.id > after][:limit]

    def forget(self, sandbox_id: str) -> None:
        self._rings.pop(sandbox_id, None)
        self.counts.pop(sandbox_id, None)
