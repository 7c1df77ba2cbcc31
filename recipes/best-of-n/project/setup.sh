#!/bin/sh
# A checkout's one-time setup; the tests need both steps:
#   1. install the vendored dependencies (vendor/) into .deps/, on a .pth, byte-compiled:
#      what pip would do with their wheels, offline;
#   2. build data/cells.json, the nearest-store table: CPU-bound, its cost grows with
#      SAMPLES squared (1024 cells x SAMPLES^2 searches over every store).
# Usage: sh setup.sh [SAMPLES]    (default 3)
set -eu
cd "$(dirname "$0")"
python3 tools/install_vendored.py
python3 tools/build_cells.py --samples "${1:-3}"
