"""Reclaim under memory pressure, over the real app and a fake VM driver, on a host whose
/proc/meminfo the test writes: below the low watermark idle sandboxes are hibernated,
paused ones first, then the least recently used, until the high watermark; protected,
busy and recently used ones are left alone; a fork that would not fit first makes room;
when nothing can be taken it is a 429 saying why; a request that comes while its
sandbox is being hibernated waits and wakes it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd.controller.app import create_app
from forkd.controller.services import Services
from forkd.controller.services.activity import request_scope
from forkd.controller.settings import Settings
from tests.unit.conftest import TOKEN, fake_meminfo
from tests.unit.fakes import FakeDriver

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(
    settings: Settings, driver: FakeDriver, meminfo: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    """The app on a host with 1000 MiB available: under its low watermark (1500)."""
    settings.memory_reserve_mib = 512
    settings.reclaim_low_mib, settings.reclaim_high_mib = 1500, 2000
    settings.reclaim_idle_s = 0
    with TestClient(create_app(settings, TOKEN, driver=driver), headers=AUTH) as c:
        events = _services(c).events
        publish = events.publish
        c.published = []  # type: ignore[attr-defined]

        def keep(kind: str, **fields: Any) -> None:
            c.published.append((kind, fields))  # type: ignore[attr-defined]
            publish(kind, **fields)

        monkeypatch.setattr(events, "publish", keep)
        assert c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 256}).status_code == 201
        yield c


def _services(client: TestClient) -> Services:
    services: Services = client.app.state.services  # type: ignore[attr-defined]
    return services


def _fork(client: TestClient, **body: Any) -> str:
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "py", **body})
    assert r.status_code == 201, r.text
    return str(r.json()[0]["id"])


def _states(client: TestClient) -> dict[str, str]:
    return {s["id"]: s["state"] for s in client.get("/v1/sandboxes").json()}


def _reclaim(client: TestClient) -> list[str]:
    taken: list[str] = client.portal.call(_services(client).reclaim.reclaim_once)  # type: ignore[union-attr]
    return taken


def _freeing(client: TestClient, meminfo: Path, mib: int) -> None:
    """Each eviction gives ``mib`` back, as a QEMU that ends does."""
    reclaim = _services(client).reclaim
    evict = reclaim.evict
    available = [1000]

    async def freeing(sandbox_id: str, idle: Callable[..., bool], available_mib: int = 0) -> bool:
        done = await evict(sandbox_id, idle, available_mib)
        if done:
            available[0] += mib
            fake_meminfo(meminfo, 4096, available[0])
        return done

    reclaim.evict = freeing  # type: ignore[method-assign]


def test_under_the_low_watermark_idle_ones_go_paused_first_then_least_recently_used(
    client: TestClient, meminfo: Path
) -> None:
    old, paused, recent = _fork(client), _fork(client), _fork(client)
    client.post(f"/v1/sandboxes/{paused}/pause")
    client.post(f"/v1/sandboxes/{recent}/exec", json={"args": ["true"]})
    time.sleep(0.01)
    _freeing(client, meminfo, 600)  # 1000 + 2 x 600 = 2200: over the high watermark
    assert _reclaim(client) == [paused, old]
    assert _states(client) == {old: "hibernated", paused: "hibernated", recent: "running"}
    said = [f for kind, f in client.published if kind == "hibernated"]  # type: ignore[attr-defined]
    assert [(f["sandbox_id"], f["reason"]) for f in said] == [
        (paused, "memory_pressure"),
        (old, "memory_pressure"),
    ]
    assert "forkd_evictions_total 2" in client.get("/metrics").text
    assert _reclaim(client) == []  # 2200 available: above the low watermark


def test_protected_busy_and_recently_used_sandboxes_are_never_taken(
    client: TestClient, settings: Settings
) -> None:
    protected = _fork(client, evictable=False)
    no_wake = _fork(client, auto_resume=False)  # running: a request could not wake it
    busy = _fork(client)
    services = _services(client)
    with request_scope():  # a request is using it (a followed stream, a terminal)
        services.activity.touch(busy)
        assert _reclaim(client) == []
    assert set(_states(client).values()) == {"running"}
    settings.reclaim_idle_s = 3600
    assert _reclaim(client) == []  # used in the last hour: all of them
    settings.reclaim_idle_s = 0
    assert _reclaim(client) == [busy]  # the request ended
    assert _states(client) == {protected: "running", no_wake: "running", busy: "hibernated"}
    r = client.post(f"/v1/sandboxes/{busy}/exec", json={"args": ["echo", "back"]})
    assert r.status_code == 200 and r.json()["stdout"] == "back\n"  # woken on demand


def test_a_sandbox_whose_processes_write_is_not_idle(
    client: TestClient, driver: FakeDriver
) -> None:
    sid = _fork(client)
    r = client.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": ["serve", "8000"]})
    assert r.status_code == 201, r.text
    vm = next(vm for vm in driver.vms if vm.id == sid)
    time.sleep(0.2)
    assert _reclaim(client) == []  # it wrote since the last look
    proc = vm.processes.procs[int(r.json()["pid"])]
    client.portal.call(asyncio.sleep, 0)  # type: ignore[union-attr]
    proc.write("stdout", b"more")
    assert _reclaim(client) == []
    assert _reclaim(client) == [sid]  # quiet since


def test_a_fork_that_would_not_fit_first_hibernates_idle_ones_and_else_says_why(
    client: TestClient, meminfo: Path, settings: Settings
) -> None:
    settings.reclaim_low_mib = settings.reclaim_high_mib = 0  # no watermark: only forks
    idle = _fork(client)
    _freeing(client, meminfo, 600)
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 20})  # 960 > 488 left
    assert r.status_code == 201, r.text
    assert _states(client)[idle] == "hibernated"
    fake_meminfo(meminfo, 4096, 600)
    settings.reclaim_idle_s = 3600  # the 20 were used just now: none is idle
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 5})
    assert r.status_code == 429
    said = r.json()["error"]
    assert "short by" in said and "reclaim found 0 idle sandboxes to hibernate of 20" in said


def test_a_fork_over_a_cap_no_eviction_can_lift_hibernates_nothing(
    client: TestClient, meminfo: Path, settings: Settings
) -> None:
    """A request --max-sandboxes refuses anyway is refused before reclaim takes anything
    (a refusal changes nothing: the integration suite's limits test met it)."""
    settings.reclaim_low_mib = settings.reclaim_high_mib = 0
    idle = _fork(client)
    _freeing(client, meminfo, 600)
    settings.max_sandboxes = 10
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 20})
    assert r.status_code == 429 and "--max-sandboxes" in r.json()["error"]
    assert _states(client)[idle] == "running"


def test_a_request_that_comes_while_its_sandbox_is_hibernated_waits_and_wakes_it(
    client: TestClient,
) -> None:
    sid = _fork(client)
    hibernation = _services(client).pausing.hibernation
    real = hibernation.hibernate
    started = threading.Event()

    async def slow(sandbox_id: str, **kw: Any) -> None:
        started.set()
        await asyncio.sleep(0.5)
        await real(sandbox_id, **kw)

    hibernation.hibernate = slow  # type: ignore[method-assign]
    reclaimed: list[list[str]] = []
    thread = threading.Thread(target=lambda: reclaimed.append(_reclaim(client)))
    thread.start()
    assert started.wait(5)
    r = client.post(f"/v1/sandboxes/{sid}/exec", json={"args": ["echo", "hi"]})
    thread.join(10)
    assert reclaimed == [[sid]]
    assert r.status_code == 200 and r.json()["stdout"] == "hi\n"
    assert float(r.headers["forkd-wake-ms"]) > 0  # it waited, then woke it
    assert _states(client)[sid] == "running"


def test_a_sandbox_protected_after_its_fork_is_never_taken(client: TestClient) -> None:
    sid = _fork(client)
    r = client.patch(f"/v1/sandboxes/{sid}", json={"evictable": False})
    assert r.status_code == 200 and r.json()["evictable"] is False
    assert r.json()["auto_resume"] is True  # left out: kept
    assert _reclaim(client) == []
    assert client.patch(f"/v1/sandboxes/{sid}", json={"evictable": True}).status_code == 200
    assert _reclaim(client) == [sid]


@pytest.mark.parametrize(
    "body", [{"evictable": "no"}, {"protected": True}, {"auto_resume": None, "x": 1}, []]
)
def test_an_update_that_is_not_understood_changes_nothing(client: TestClient, body: Any) -> None:
    sid = _fork(client)
    r = client.patch(f"/v1/sandboxes/{sid}", json=body)
    assert r.status_code == 400, r.text
    info = client.get(f"/v1/sandboxes/{sid}").json()
    assert info["evictable"] is True and info["auto_resume"] is True
    assert client.patch("/v1/sandboxes/sb-nope-0001", json={}).status_code == 404


def test_reclaim_never_fills_the_disk_to_give_memory_back(
    client: TestClient, meminfo: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.controller.services import disk_room

    sid = _fork(client)
    # The guest's 256 MiB and the 1 GiB reserve do not fit in 1200 MiB (a user's own
    # hibernate, which needs the reserve only, would).
    monkeypatch.setattr(disk_room, "free_bytes", lambda _path: 1200 << 20)
    assert _reclaim(client) == [] and _reclaim(client) == []
    assert _states(client) == {sid: "running"}
    assert not [d for d in settings.snapshot_root.iterdir() if d.name.startswith(".hibern")]
    fake_meminfo(meminfo, 4096, 600)
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 5})
    assert r.status_code == 429
    said = r.json()["error"]
    assert "skipped for disk" in said and "has 1200 MiB free" in said, said
    monkeypatch.setattr(disk_room, "free_bytes", lambda _path: 1300 << 20)
    assert _reclaim(client) == [sid]  # room again: the next pass takes it
    assert "skipped for disk" not in _services(client).reclaim.busy_summary()


@pytest.mark.parametrize(
    "answer",
    [
        [1],
        ["x"],
        [{"output_end": float("nan")}],
        [{"output_end": 1e400}],
        [{"output_end": -1}],
        [{"output_end": True}],
        "x",
        None,
    ],
)
def test_a_guest_that_answers_nonsense_is_taken_and_does_not_stop_the_pass(
    client: TestClient, driver: FakeDriver, meminfo: Path, answer: Any
) -> None:
    hostile, other = _fork(client), _fork(client)
    vm = next(vm for vm in driver.vms if vm.id == hostile)

    async def nonsense() -> Any:
        return answer

    vm.proc_list = nonsense  # type: ignore[method-assign]
    _freeing(client, meminfo, 600)
    # Its answer shows no output: it is as quiet as any, and the pass goes on past it.
    assert _reclaim(client) == [hostile, other]


def test_a_guest_that_does_not_answer_is_taken_after_one_wait(
    client: TestClient, driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.controller.services import reclaim

    monkeypatch.setattr(reclaim, "OUTPUT_CHECK_SECS", 0.2)
    silent = _fork(client)
    vm = next(vm for vm in driver.vms if vm.id == silent)

    async def never() -> Any:
        await asyncio.sleep(3600)

    vm.proc_list = never  # type: ignore[method-assign]
    t0 = time.monotonic()
    assert _reclaim(client) == [silent]  # not kept out of reclaim by its silence
    assert time.monotonic() - t0 < 5


def test_one_sandbox_s_failure_does_not_end_the_pass(
    client: TestClient, meminfo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = _fork(client), _fork(client)
    reclaim = _services(client).reclaim
    evict = reclaim.evict

    async def breaks_once(
        sandbox_id: str, idle: Callable[..., bool], available_mib: int = 0
    ) -> bool:
        if sandbox_id == first:
            raise RuntimeError("something nobody expected")
        return await evict(sandbox_id, idle, available_mib)

    reclaim.evict = breaks_once  # type: ignore[method-assign]
    assert _reclaim(client) == [second]
    assert "could not be taken" in caplog.text
    assert _states(client) == {first: "running", second: "hibernated"}


def test_a_sandbox_whose_lock_is_held_is_skipped(client: TestClient) -> None:
    busy, other = _fork(client), _fork(client)
    lock = _services(client).holds.sandbox_lock(busy)  # a branch writing its files
    client.portal.call(lock.acquire)  # type: ignore[union-attr]
    try:
        assert _reclaim(client) == [other]
    finally:
        lock.release()
    assert _reclaim(client) == [busy]


def test_an_eviction_keeps_the_sandbox_s_timeout(client: TestClient) -> None:
    sid = _fork(client, timeout_s=600, on_timeout="kill")
    expires = client.get(f"/v1/sandboxes/{sid}").json()["expires_at_unix"]
    assert _reclaim(client) == [sid]
    info = client.get(f"/v1/sandboxes/{sid}").json()
    assert info["state"] == "hibernated" and info["expires_at_unix"] == expires
    r = client.post(f"/v1/sandboxes/{sid}/exec", json={"args": ["true"]})  # woken
    assert r.status_code == 200, r.text
    assert client.get(f"/v1/sandboxes/{sid}").json()["expires_at_unix"] == expires
    # A user's own hibernate still clears it, as documented.
    assert client.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True}).status_code == 200
    assert client.get(f"/v1/sandboxes/{sid}").json()["expires_at_unix"] is None


def test_stop_waits_for_a_pass_under_way(client: TestClient) -> None:
    sid = _fork(client)
    services = _services(client)
    hibernation = services.pausing.hibernation
    real = hibernation.hibernate

    async def slow(sandbox_id: str, **kw: Any) -> None:
        await asyncio.sleep(0.3)
        await real(sandbox_id, **kw)

    hibernation.hibernate = slow  # type: ignore[method-assign]

    async def ask_then_leave_then_stop() -> None:
        asker = asyncio.create_task(services.reclaim.reclaim_once())
        await asyncio.sleep(0.05)
        asker.cancel()  # the pass is shielded from it: it goes on
        await services.reclaim.stop()

    client.portal.call(ask_then_leave_then_stop)  # type: ignore[union-attr]
    assert _states(client) == {sid: "hibernated"}  # ended before stop returned


def test_the_timeout_of_an_evicted_sandbox_acts_on_it_while_it_sleeps(
    client: TestClient, settings: Settings
) -> None:
    sid = _fork(client, timeout_s=1, on_timeout="kill")
    assert _reclaim(client) == [sid]
    deadline = time.monotonic() + 10
    while client.get(f"/v1/sandboxes/{sid}").status_code != 404:
        assert time.monotonic() < deadline, "the timeout did not act on it"
        time.sleep(0.1)
    assert not [d for d in settings.snapshot_root.iterdir() if sid in d.name]  # its state too
