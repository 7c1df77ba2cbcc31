"""Build data/cells.json, the table a storefinder.Finder reads.

For every geohash cell of ``CELL_PRECISION`` characters (1024 cells), the candidates:
the stores that lie in the cell, and the store nearest to each point of a SAMPLES x
SAMPLES grid over it. A Finder then measures only a cell's few candidates instead of
every store. Deterministic: the same store list and SAMPLES give the same bytes. The
cost is 1024 x SAMPLES^2 nearest-store searches over the whole list, all CPU.

Usage: python3 tools/build_cells.py [--samples N] [--out data/cells.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import geohash_lite  # installed by tools/install_vendored.py
import storefinder


def candidates(cell: str, stores: list[storefinder.Store], samples: int) -> list[str]:
    south, north, west, east = geohash_lite.bounds(cell)
    found = {s.id for s in stores if south <= s.lat < north and west <= s.lon < east}
    for i in range(samples):
        lat = south + (i + 0.5) * (north - south) / samples
        for j in range(samples):
            lon = west + (j + 0.5) * (east - west) / samples
            found.add(storefinder.nearest((lat, lon), stores).id)
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3, help="grid points per cell side")
    parser.add_argument("--out", type=Path, default=storefinder.CELLS_JSON)
    args = parser.parse_args()
    started = time.monotonic()
    stores = storefinder.load_stores()
    precision = storefinder.CELL_PRECISION
    cells = {c: candidates(c, stores, args.samples) for c in geohash_lite.cells(precision)}
    table = {"precision": precision, "samples": args.samples,
             "stores_sha256": storefinder.stores_digest(), "cells": cells}  # fmt: skip
    args.out.write_text(json.dumps(table, sort_keys=True, separators=(",", ":")) + "\n")
    took = time.monotonic() - started
    searches = len(cells) * args.samples**2
    print(f"built {args.out.name}: {len(cells)} cells, {args.samples}x{args.samples} samples each, "
          f"{searches:,} searches over {len(stores)} stores in {took:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
