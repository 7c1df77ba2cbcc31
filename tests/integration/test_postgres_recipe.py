"""The postgres image and the postgres-fixture recipe, end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Daemon

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_postgres_fixture_demo(daemon: Daemon) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "postgres-fixture" / "demo.py")],
        cwd=ROOT,
        env={**daemon.env(), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.count("sees its own row only") == 3
    assert "the template still has the original fixture" in out
    assert "FAIL" not in out
    assert "all checks passed" in out
