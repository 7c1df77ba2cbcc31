"""Which store is nearest to a customer.

By great-circle distance to every store (:func:`nearest`, :func:`within`), or quickly
through a :class:`Finder`: it reads data/cells.json, a table of the candidate stores of
each geohash cell, built once per checkout from data/stores.csv by tools/build_cells.py
(see setup.sh), and measures only the candidates of the customer's cell.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import geohash_lite

DATA = Path(__file__).resolve().parent / "data"
STORES_CSV = DATA / "stores.csv"
CELLS_JSON = DATA / "cells.json"
EARTH_RADIUS_KM = 6371.0088  # the mean radius
CELL_PRECISION = 2  # geohash characters of a table cell: 1024 cells of 11.25 x 5.625 degrees
COORD = re.compile(
    r"\s*([-+]?\d+(?:\.\d+)?)\s*([NS]?)\s*,\s*([-+]?\d+(?:\.\d+)?)\s*([EW]?)\s*", re.IGNORECASE
)

Point = tuple[float, float]  # (latitude, longitude) in degrees


@dataclass(frozen=True)
class Store:
    id: str
    city: str
    lat: float
    lon: float

    @property
    def point(self) -> Point:
        return self.lat, self.lon


def load_stores(path: Path = STORES_CSV) -> list[Store]:
    with path.open(newline="") as f:
        return [Store(r["id"], r["city"], float(r["lat"]), float(r["lon"]))
                for r in csv.DictReader(f)]  # fmt: skip


def stores_digest(path: Path = STORES_CSV) -> str:
    """The store list's sha256: the cell table names the list it was built from."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_coord(text: str) -> Point:
    """``"48.8566N, 2.3522E"`` or ``"-33.8688, 151.2093"`` as a point."""
    m = COORD.fullmatch(text)
    if not m:
        raise ValueError(f"not a coordinate: {text!r}")
    lat, lon = float(m.group(1)), float(m.group(3))
    if m.group(2).upper() == "S":
        lat = -lat
    if m.group(4).upper() == "E":
        lon = -lon
    if not (-90 <= lat <= 90 and -180 <= lon <= 180):
        raise ValueError(f"out of range: {text!r}")
    return lat, lon


def distance_km(a: Point, b: Point) -> float:
    """The great-circle distance between two points (haversine)."""
    lat1, lon1, lat2, lon2 = map(math.radians, (*a, *b))
    h = (math.sin((lat2 - lat1) / 2) ** 2
         + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2)  # fmt: skip
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def nearest(point: Point, stores: list[Store]) -> Store:
    """The store nearest to ``point``, measuring every one."""
    return min(stores, key=lambda s: distance_km(point, s.point))


def within(point: Point, km: float, stores: list[Store]) -> list[tuple[Store, float]]:
    """The stores at most ``km`` from ``point`` with their distances, nearest first."""
    found = [(s, distance_km(point, s.point)) for s in stores]
    return sorted((f for f in found if f[1] <= km), key=lambda f: f[0].city)


class Finder:
    """Nearest-store lookups through the cell table."""

    def __init__(self, stores: list[Store] | None = None, table: Path = CELLS_JSON) -> None:
        self.stores = {s.id: s for s in (stores if stores is not None else load_stores())}
        if not table.exists():
            raise FileNotFoundError(f"{table} is missing: run setup.sh to build it")
        data = json.loads(table.read_text())
        self.precision: int = data["precision"]
        self.built_from: str = data["stores_sha256"]
        self.cells: dict[str, list[str]] = data["cells"]

    def candidates(self, point: Point) -> list[Store]:
        """The stores that may be nearest to ``point``: its cell's."""
        cell = geohash_lite.encode(point[1], point[0], self.precision)
        return [self.stores[i] for i in self.cells[cell]]

    def nearest(self, point: Point) -> Store:
        return nearest(point, self.candidates(point))
