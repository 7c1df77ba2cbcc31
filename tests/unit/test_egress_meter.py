"""A sandbox's share of the egress proxy (forkd.egress.meter) and the operator's rate
(``forkd serve --egress-rate``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forkd.cli import app as cli_app
from forkd.controller.settings import Settings
from forkd.egress.meter import MIN_GRANT, Meter
from forkd.token_bucket import TokenBucket


def test_grants_never_hold_more_than_the_share_and_a_give_lets_the_next_one_on() -> None:
    async def main() -> list[str]:
        meter = Meter(held_cap=64 * 1024)
        said: list[str] = []
        first = await meter.grant(48 * 1024)
        second = await meter.grant(48 * 1024)  # only the rest of the share
        assert (first, second, meter.held) == (48 * 1024, 16 * 1024, 64 * 1024)

        async def third() -> None:
            said.append(f"third got {await meter.grant(8 * 1024)}")

        waiting = asyncio.ensure_future(third())
        await asyncio.sleep(0.05)
        said.append("third waits")  # the share is full
        meter.give(first)
        await waiting
        assert meter.peak == 64 * 1024 and meter.held == 16 * 1024 + 8 * 1024
        return said

    assert asyncio.run(main()) == ["third waits", "third got 8192"]


def test_a_chunk_in_hand_waits_for_room_and_may_overshoot_by_itself_only() -> None:
    async def main() -> int:
        meter = Meter(held_cap=16 * 1024)
        await meter.grant(16 * 1024 - MIN_GRANT + 1)  # less than MIN_GRANT left
        held = asyncio.ensure_future(meter.hold(100_000))
        await asyncio.sleep(0.05)
        assert not held.done()
        meter.give(16 * 1024 - MIN_GRANT + 1)
        return await held

    assert asyncio.run(main()) == 100_000


def test_a_share_below_one_grant_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        Meter(held_cap=MIN_GRANT - 1)


def test_the_bucket_lets_a_seconds_burst_through_then_holds_to_the_rate() -> None:
    now = [100.0]
    bucket = TokenBucket(1000, 1000, clock=lambda: now[0])  # as Meter makes each
    assert bucket.take(1000) == 0.0  # the burst
    assert bucket.take(500) == pytest.approx(0.5)  # a debt: wait half a second
    now[0] += 0.5
    assert bucket.take(1000) == pytest.approx(1.0)
    now[0] += 10  # idle: refilled to one second's worth, no more
    assert bucket.take(1000) == 0.0
    assert bucket.take(1) > 0


def test_pace_waits_only_with_a_rate() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        free, paced = Meter(), Meter(rate=1 << 20)
        started = loop.time()
        await free.pace(10 << 20, outward=True)
        free_took = loop.time() - started
        started = loop.time()
        await paced.pace((1 << 20) + (1 << 18), outward=True)  # a quarter second past the burst
        await paced.pace(1 << 20, outward=False)  # the other way has its own bucket
        return free_took, loop.time() - started

    free_took, paced_took = asyncio.run(main())
    assert free_took < 0.05 and 0.2 <= paced_took < 1.0


@pytest.mark.parametrize(
    ("given", "rate"),
    [
        ([], None),
        (["--egress-rate", "20M"], 20 << 20),
        (["--egress-rate", "512K/s"], 512 << 10),
        (["--egress-rate", "off"], None),
    ],
)
def test_forkd_serve_takes_the_rate_into_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: list[str], rate: int | None
) -> None:
    taken: list[Settings] = []
    monkeypatch.setattr("forkd.controller.server.serve", lambda s, *_a, **_k: taken.append(s))
    monkeypatch.setattr("forkd.cli.daemon._use_qemu_user", lambda *_args: None)
    base = ["serve", "--state-dir", str(tmp_path), "--cgroup-parent", "none", "--accel", "tcg"]
    result = CliRunner().invoke(cli_app, base + given)
    assert result.exit_code == 0, result.output
    assert taken[0].egress_rate == rate


def test_forkd_serve_refuses_a_rate_it_cannot_read(tmp_path: Path) -> None:
    base = ["serve", "--state-dir", str(tmp_path), "--cgroup-parent", "none", "--accel", "tcg"]
    result = CliRunner().invoke(cli_app, [*base, "--egress-rate", "fast"])
    assert result.exit_code != 0 and "--egress-rate 'fast'" in result.output
