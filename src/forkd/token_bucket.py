"""A token bucket: ``rate`` tokens a second, at most ``burst`` saved up.

:meth:`TokenBucket.take` never refuses: it says how long the taker should pause to
pay back an overdraft. Used where a peer's stream is paced: what the daemon reads
from a guest's agent (:mod:`forkd.vmm.agent.client`) and what a sandbox moves
through the egress proxy (:mod:`forkd.egress.meter`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    def __init__(
        self,
        rate: float,
        burst: float,
        clock: Callable[[], float] = time.monotonic,
        min_pause: float = 0.0,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.min_pause = min_pause  # an overdraft pauses at least this long: few wake-ups
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def take(self, n: float) -> float:
        """Take ``n`` tokens; the seconds to pause before using them (0 when there were
        enough)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate) - n
        self._at = now
        if self._tokens >= 0:
            return 0.0
        return max(-self._tokens / self.rate, self.min_pause)
