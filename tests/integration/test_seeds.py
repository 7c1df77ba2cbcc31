"""Forks with a seed on real VMs: the same seed replays the same random numbers, in the
warm interpreter and in a new Python process; different seeds differ; os.urandom stays
unique to each child whatever its seed."""

from __future__ import annotations

import pytest

from forkd.client import Controller

pytestmark = pytest.mark.integration

DRAW = ["python3", "-c", "import random, os; print(random.random(), os.urandom(8).hex())"]


def _draws(ctl: Controller, sid: str) -> tuple[str, str, str]:
    warm = ctl.eval_code(sid, "import random\nrandom.random()")["result"]
    fresh, urandom = ctl.exec_command(sid, DRAW)["stdout"].split()
    return warm, fresh, urandom


def test_the_same_seed_replays_and_urandom_stays_unique(ctl: Controller, api_template: str) -> None:
    first = ctl.spawn_sandboxes(api_template, n=2, seed=7)
    again = ctl.spawn_sandboxes(api_template, n=1, seed=7)
    other = ctl.spawn_sandboxes(api_template, n=1, seed=1000)
    try:
        assert [s["seed"] for s in first + again + other] == [7, 8, 7, 1000]
        a, b, c, d = (_draws(ctl, s["id"]) for s in first + again + other)
        assert a[:2] == c[:2]  # seed 7 twice: the same numbers, warm and fresh
        assert a[0] != b[0] and a[1] != b[1]  # seed 8 differs
        assert d[0] not in (a[0], b[0])
        assert len({a[2], b[2], c[2], d[2]}) == 4  # the kernel's entropy: each its own
    finally:
        for s in first + again + other:
            ctl.kill_sandbox(s["id"])
