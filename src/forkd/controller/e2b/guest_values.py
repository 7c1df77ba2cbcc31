"""A guest's word made fit for E2B's messages: the daemon checks an agent's answer has
its shape (types), and here its values are kept in the ranges protobuf and JSON can
carry (a guest can answer NaN, a size past int64, a name that is not UTF-8), so a
hostile or odd answer never becomes a 500."""

from __future__ import annotations

import math

INT64_MAX = (1 << 63) - 1
UINT32_MAX = (1 << 32) - 1
LATEST_UNIX = 253_402_300_799  # 9999-12-31T23:59:59Z, the last time RFC 3339 writes


def text(value: str) -> str:
    """``value`` as valid UTF-8: a name that was not (decoded with lone surrogates) has
    U+FFFD where its undecodable bytes were."""
    try:  # a byte the guest could not decode, as Python carries it (surrogateescape)
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # any other lone surrogate
        raw = value.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def clamped(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def unix_time(value: float) -> float:
    """A time a Timestamp can hold: NaN and infinities are 0, the rest within RFC 3339."""
    if not math.isfinite(value):
        return 0.0
    return max(0.0, min(float(LATEST_UNIX), value))
