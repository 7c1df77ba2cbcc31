"""geohash_lite: encode (latitude, longitude) as geohash strings, and back.

A geohash names a cell of the globe: each character adds five bits, alternately
halving the cell's longitude and latitude ranges, so a longer hash is a smaller cell
and hashes that share a prefix share a cell. Pure Python, no dependencies.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product

__version__ = "1.2.0"
__all__ = ["BASE32", "bounds", "cells", "decode", "encode"]

BASE32 = "0123456789bcdefghjkmnpqrstuvwxyz"
_INDEX = {c: i for i, c in enumerate(BASE32)}


def encode(lat: float, lon: float, precision: int = 9) -> str:
    """The geohash of ``precision`` characters of the cell holding (lat, lon)."""
    if not (-90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0):
        raise ValueError(f"not a position: ({lat}, {lon})")
    lat_range, lon_range = [-90.0, 90.0], [-180.0, 180.0]
    chars, value, bits, even = [], 0, 0, True
    while len(chars) < precision:
        rng, x = (lon_range, lon) if even else (lat_range, lat)
        mid = (rng[0] + rng[1]) / 2
        value <<= 1
        if x >= mid:
            value |= 1
            rng[0] = mid
        else:
            rng[1] = mid
        even, bits = not even, bits + 1
        if bits == 5:
            chars.append(BASE32[value])
            value, bits = 0, 0
    return "".join(chars)


def bounds(geohash: str) -> tuple[float, float, float, float]:
    """The cell of ``geohash``: (south, north, west, east), in degrees."""
    lat_range, lon_range = [-90.0, 90.0], [-180.0, 180.0]
    even = True
    for char in geohash.lower():
        if char not in _INDEX:
            raise ValueError(f"not a geohash: {geohash!r}")
        value = _INDEX[char]
        for shift in range(4, -1, -1):
            rng = lon_range if even else lat_range
            mid = (rng[0] + rng[1]) / 2
            rng[0 if (value >> shift) & 1 else 1] = mid
            even = not even
    return lat_range[0], lat_range[1], lon_range[0], lon_range[1]


def decode(geohash: str) -> tuple[float, float]:
    """The centre of the cell of ``geohash``: (lat, lon)."""
    south, north, west, east = bounds(geohash)
    return (south + north) / 2, (west + east) / 2


def cells(precision: int) -> Iterator[str]:
    """Every geohash of ``precision`` characters (32 ** precision of them), in order."""
    for chars in product(BASE32, repeat=precision):
        yield "".join(chars)
