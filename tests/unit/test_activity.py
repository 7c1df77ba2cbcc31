"""Activity: which sandboxes are in use and since when, and what a guest's process list
is believed to say about its output (hostile input)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from forkd.controller.services.activity import Activity, output_total, request_scope
from forkd.controller.services.holds import Holds
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.records import Records
from forkd.controller.services.waking import Waker


@pytest.mark.parametrize(
    ("listed", "total"),
    [
        ([], 0),
        ([{"output_end": 5}, {"output_end": 7}], 12),
        ([{"pid": 3}], 0),  # an agent older than output_end
        ([{"output_end": None}], 0),
        ([{"output_end": -1}], None),
        ([{"output_end": 1.5}], None),
        ([{"output_end": True}], None),
        ([{"output_end": "12"}], None),
        ([{"output_end": 1 << 63}], None),
        ([1], None),
        ([[]], None),
        ({"output_end": 1}, None),
        ("x", None),
        (None, None),
        ([{}] * 5000, None),  # more processes than any agent keeps
    ],
)
def test_a_guest_s_process_list_is_believed_only_when_it_fits(listed: Any, total: Any) -> None:
    assert output_total(listed) == total


def test_nonsense_is_no_output_and_no_use() -> None:
    activity = Activity()
    assert activity.output_written("sb-1", [{"output_end": 10}]) is True  # wrote: use
    assert activity.last_active("sb-1") is not None
    activity.forget("sb-1")
    assert activity.output_written("sb-1", [{"output_end": float("nan")}]) is False
    assert activity.last_active("sb-1") is None


def test_a_request_that_ends_after_its_sandbox_was_forgotten_leaves_nothing() -> None:
    activity = Activity()
    with request_scope():  # a DELETE: touches the sandbox, which is then forgotten
        activity.touch("sb-1")
        activity.forget("sb-1")
    assert activity.last_active("sb-1") is None and not activity.in_use("sb-1")
    with request_scope():  # one that lives on is used until the request's end
        activity.touch("sb-2")
        assert activity.in_use("sb-2")
    assert not activity.in_use("sb-2") and activity.last_active("sb-2") is not None


def _waker(resume: Callable[[str], Awaitable[str]]) -> Waker:
    """A waker whose wakes no request asks a VM of: only its holds are used."""
    return Waker(Holds(), cast(Records, None), cast(LiveVMs, None), resume)


def test_draining_lets_a_wake_whose_waiters_left_end() -> None:
    ended: list[str] = []

    async def resume(sandbox_id: str) -> str:
        await asyncio.sleep(0.2)
        ended.append(sandbox_id)
        return "hibernated"

    async def main() -> None:
        waker = _waker(resume)
        waiter = asyncio.create_task(waker("sb-1"))
        await asyncio.sleep(0.05)
        waiter.cancel()  # its client left; the wake is shielded and goes on
        await waker.drain(5)
        assert ended == ["sb-1"] and not waker.waking("sb-1")

    asyncio.run(main())


def test_a_wake_that_outlasts_the_drain_is_cancelled() -> None:
    async def resume(sandbox_id: str) -> str:
        await asyncio.sleep(3600)
        return "hibernated"

    async def main() -> None:
        waker = _waker(resume)
        waiter = asyncio.create_task(waker("sb-1"))
        await asyncio.sleep(0.05)
        await waker.drain(0.1)
        assert not waker.waking("sb-1")
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())
