"""One sandbox's share of the egress proxy in bytes: what its connections may hold in
the daemon at once, and (when the operator set one) how fast they may move.

*Held* bytes are read from one side of a connection and not yet taken by the other
side's socket. A guest that floods an upstream which does not read (or the other
way round) fills its own share and then waits; the daemon's memory for it stays
bounded however many connections it opens, and its siblings' connections go on.

The *rate* is a :class:`~forkd.token_bucket.TokenBucket` per direction holding one
second of bytes: bursts up to a second's worth pass at once, and a sustained flow
is held to the rate.
"""

from __future__ import annotations

import asyncio
import re

from forkd.token_bucket import TokenBucket

HELD_BYTES = 8 << 20  # per sandbox, every connection's together
MIN_GRANT = 4096  # a read waits until at least this much of the share is free


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_rate(text: str) -> int | None:
    """``off`` (None), or bytes a second: ``20M``, ``512K/s``, ``1G``, ``300000``."""
    if text.strip().lower() in ("off", "0", ""):
        return None
    found = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?(?:/s)?\s*", text, re.IGNORECASE)
    if found is None or int(found.group(1)) == 0:
        raise ValueError(f"{text!r}: off, or bytes a second such as 20M")
    return int(found.group(1)) * _UNITS[found.group(2).upper()]


class Meter:
    def __init__(self, held_cap: int = HELD_BYTES, rate: int | None = None) -> None:
        if held_cap < MIN_GRANT:
            raise ValueError(f"a sandbox's share of the egress proxy is at least {MIN_GRANT} B")
        self.cap = held_cap
        self.held = 0
        self.peak = 0  # the most ever held at once
        self._room = asyncio.Event()
        self._room.set()
        self._buckets = (TokenBucket(rate, rate), TokenBucket(rate, rate)) if rate else None

    async def grant(self, wanted: int) -> int:
        """Hold up to ``wanted`` bytes of the share, waiting until at least MIN_GRANT (or
        ``wanted``, if less) is free; how many were granted. Give them back with
        :meth:`give`."""
        await self._room_for(min(wanted, MIN_GRANT))
        return self._take(min(wanted, self.cap - self.held))

    async def hold(self, n: int) -> int:
        """Count ``n`` bytes already in hand, once at least MIN_GRANT (or ``n``) of the
        share is free: the share may be exceeded by this one chunk."""
        await self._room_for(min(n, MIN_GRANT))
        return self._take(n)

    async def _room_for(self, floor: int) -> None:
        while self.cap - self.held < floor:
            self._room.clear()
            await self._room.wait()

    def _take(self, n: int) -> int:
        self.held += n
        self.peak = max(self.peak, self.held)
        return n

    def give(self, n: int) -> None:
        self.held -= n
        if self.cap - self.held >= MIN_GRANT:
            self._room.set()

    async def pace(self, n: int, outward: bool) -> None:
        """Wait as the rate asks before ``n`` bytes go on (at once without a rate)."""
        if self._buckets is None:
            return
        delay = self._buckets[0 if outward else 1].take(n)
        if delay > 0:
            await asyncio.sleep(delay)
