"""Lifecycle events (``GET /v1/events``): the bus on its own, then the real app over the
fake driver under a real uvicorn (forkd's own server class, which ends the streams at
shutdown), followed with the SDK, raw HTTP and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from forkd.client import Controller, ControllerError
from forkd.client.event_routes import Event as SdkEvent
from forkd.controller.app import create_app
from forkd.controller.server import Server as DaemonServer
from forkd.controller.services.events import EVENT_TYPES, Event, EventBus
from forkd.controller.settings import Settings
from forkd.errors import Invalid, OverCapacity
from forkd.launcher import free_port
from forkd.vmm.jail import cgroups
from tests.unit.conftest import TOKEN
from tests.unit.fakes import FakeDriver

# ------------------------------------------------------------------ the bus alone


async def _take(stream: Any, n: int, timeout: float = 2.0) -> list[Any]:
    """The next ``n`` events of ``stream`` (its position marker and heartbeats skipped)."""
    got: list[Any] = []
    while len(got) < n:
        item = await asyncio.wait_for(anext(stream), timeout)
        if item is not None and item.type:
            got.append(item)
    return got


async def _next(stream: AsyncIterator[Event | None]) -> Event:
    """The next item of ``stream``, one that is not a heartbeat (None): its position."""
    item = await anext(stream)
    assert item is not None
    return item


def test_publish_stamps_and_encodes_each_event_and_never_raises() -> None:
    async def run() -> None:
        bus = EventBus()
        stream = bus.subscribe(since=0)
        bus.publish("created", sandbox_id="sb-1", snapshot_tag="py", fork_ms=12.5)
        bus.publish("killed", sandbox_id="sb-1", odd=object())  # not JSON: sent as str
        bus.publish("no-such-type")  # logged, still published
        created, killed, odd = await _take(stream, 3)
        body = json.loads(created.data)
        assert body["type"] == "created" and body["sandbox_id"] == "sb-1"
        assert body["snapshot_tag"] == "py" and body["fork_ms"] == 12.5
        assert body["time"].endswith("Z") and body["id"] == created.id
        assert killed.id == created.id + 1 and "object" in json.loads(killed.data)["odd"]
        assert odd.type == "no-such-type"

    asyncio.run(run())


def test_replay_after_an_id_then_live() -> None:
    async def run() -> None:
        bus = EventBus()
        for n in range(5):
            bus.publish("created", sandbox_id=f"sb-{n}")
        third = bus.last_id - 2
        stream = bus.subscribe(since=third)
        position = await _next(stream)
        assert position.type == "" and position.id == third
        bus.publish("killed", sandbox_id="sb-9")
        got = await _take(stream, 3)
        assert [json.loads(e.data).get("sandbox_id") for e in got] == ["sb-3", "sb-4", "sb-9"]
        now = bus.subscribe()  # no since: from now on only
        assert (await _next(now)).id == bus.last_id

    asyncio.run(run())


def test_a_stream_that_fell_off_the_ring_gets_a_gap_then_what_is_held() -> None:
    async def run() -> None:
        bus = EventBus(ring_size=10)
        stream = bus.subscribe()  # reads nothing while 25 are published
        start = (await _next(stream)).id
        for n in range(25):
            bus.publish("created", sandbox_id=f"sb-{n}")
        gap, *rest = await _take(stream, 11)
        body = json.loads(gap.data)
        assert gap.type == "gap" and body["after"] == start and body["missed"] == 15
        assert gap.id == start + 15  # a client that reconnects from it gets no second gap
        assert [json.loads(e.data)["sandbox_id"] for e in rest] == [
            f"sb-{n}" for n in range(15, 25)
        ]
        assert len(bus._ring) == 10  # the ring is all that is kept, whoever reads slowly

    asyncio.run(run())


def test_an_id_from_an_earlier_run_or_unknown_is_a_gap_never_a_silent_skip() -> None:
    async def run() -> None:
        bus = EventBus()
        bus.publish("created", sandbox_id="sb-1")
        earlier = bus.subscribe(since=1)  # ids of an earlier run are smaller
        await anext(earlier)
        gap, created = await _take(earlier, 2)
        assert gap.type == "gap" and json.loads(gap.data)["missed"] is None
        assert created.type == "created"
        future = bus.subscribe(since=bus.last_id + 1000)
        await anext(future)
        (gap,) = await _take(future, 1)
        assert gap.type == "gap" and gap.id == bus.last_id

    asyncio.run(run())


def test_filters_on_type_and_sandbox_and_refuses_unknown_types() -> None:
    async def run() -> None:
        bus = EventBus()
        stream = bus.subscribe(types=["killed", "died"], sandbox_id="sb-2", since=0)
        for sid in ("sb-1", "sb-2"):
            for kind in ("created", "killed"):
                bus.publish(kind, sandbox_id=sid)
        bus.publish("died", sandbox_id="sb-2")
        got = await _take(stream, 2)
        assert [(e.type, e.sandbox_id) for e in got] == [("killed", "sb-2"), ("died", "sb-2")]
        with pytest.raises(Invalid, match="'paws'"):
            bus.subscribe(types=["paused", "paws"])

    asyncio.run(run())


def test_a_quiet_stream_sends_heartbeats_even_when_events_pass_the_filter_by() -> None:
    async def run() -> None:
        bus = EventBus(heartbeat_s=0.1)
        stream = bus.subscribe(types=["died"])
        await anext(stream)
        assert await asyncio.wait_for(anext(stream), 1) is None
        for _ in range(3):
            bus.publish("created")
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(anext(stream), 1) is None

    asyncio.run(run())


def test_the_subscriber_cap_and_a_slot_given_back() -> None:
    async def run() -> None:
        bus = EventBus(max_subscribers=2)
        first, second = bus.subscribe(), bus.subscribe()
        with pytest.raises(OverCapacity, match="cap is 2"):
            bus.subscribe()
        await anext(first)
        assert isinstance(first, AsyncGenerator)
        await first.aclose()  # a stream that ends gives its slot back
        del second  # and so does one never started
        third = bus.subscribe()
        await anext(third)
        bus.close()
        assert [item async for item in third] == []  # close ends it

    asyncio.run(run())


def test_publish_from_another_thread_wakes_the_stream() -> None:
    async def run() -> None:
        bus = EventBus()
        stream = bus.subscribe()
        await anext(stream)
        threading.Thread(target=bus.publish, args=("died",), kwargs={"sandbox_id": "x"}).start()
        (event,) = await _take(stream, 1)
        assert event.type == "died"

    asyncio.run(run())


# ------------------------------------------------------------------ the daemon


@contextmanager
def daemon(settings: Settings, driver: FakeDriver) -> Iterator[tuple[str, DaemonServer]]:
    """The app under forkd's uvicorn server on loopback, in a thread of this process."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, TOKEN, driver=driver),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=30,
    )
    srv = DaemonServer(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", srv
    finally:
        srv.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "the daemon did not stop"


@pytest.fixture
def running(settings: Settings, driver: FakeDriver) -> Iterator[tuple[str, DaemonServer]]:
    with daemon(settings, driver) as found:
        yield found


@pytest.fixture
def url(running: tuple[str, DaemonServer]) -> str:
    return running[0]


def bus_of(srv: DaemonServer) -> EventBus:
    app = srv.config.app
    assert isinstance(app, FastAPI)  # as daemon() made it
    return app.state.services.events


def _streams_open(srv: DaemonServer, n: int) -> None:
    """Wait until the daemon holds ``n`` event streams."""
    deadline = time.monotonic() + 5
    while len(bus_of(srv)._streams) < n:
        assert time.monotonic() < deadline, "the stream did not open"
        time.sleep(0.01)


class Collector:
    """An SDK ``events()`` iterator read in a thread of its own, into ``events``."""

    def __init__(self, url: str, **filters: Any) -> None:
        self.events: list[SdkEvent] = []
        self.error: BaseException | None = None
        self._ctl = Controller(url, token=TOKEN)
        self._iter = self._ctl.events(reconnect_s=0.5, **filters)
        self._connected = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for event in self._iter:
                self.events.append(event)
        except BaseException as exc:  # the daemon went away: what the test checks
            self.error = exc

    def until(self, done: Callable[[list[SdkEvent]], bool], within: float = 5.0) -> None:
        deadline = time.monotonic() + within
        while not done(self.events):
            assert time.monotonic() < deadline, f"not in time; got {self.events}"
            time.sleep(0.02)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


def test_fork_branch_kill_and_snapshots_are_published_in_order(
    running: tuple[str, DaemonServer],
) -> None:
    url, srv = running
    kinds = ["snapshot_created", "created", "branched", "killed", "snapshot_deleted"]
    watch = Collector(url, types=kinds)  # a build's snapshot_progress aside
    _streams_open(srv, 1)
    with Controller(url, token=TOKEN) as ctl:
        ctl.create_snapshot("py", memory_mib=128)
        sid = ctl.spawn_sandboxes("py")[0]["id"]
        tag = ctl.branch_sandbox(sid, "b1")["tag"]
        ctl.kill_sandbox(sid)
        ctl.delete_snapshot(tag)
    watch.until(lambda evs: len(evs) >= 5)
    assert watch.types() == [
        "snapshot_created",
        "created",
        "branched",
        "killed",
        "snapshot_deleted",
    ]
    snap, created, branched, killed, deleted = watch.events
    assert snap.snapshot_tag == "py" and deleted.snapshot_tag == "b1"
    assert created.sandbox_id == sid and created["snapshot_tag"] == "py"
    assert isinstance(created["fork_ms"], float)
    assert branched.sandbox_id == sid and branched.snapshot_tag == "b1"
    assert isinstance(branched["pause_ms"], int)
    assert killed.sandbox_id == sid
    ids = [e.id for e in watch.events]
    assert ids == sorted(ids) and len(set(ids)) == 5


def test_expiry_is_published_then_what_it_did(running: tuple[str, DaemonServer]) -> None:
    url, srv = running
    watch = Collector(url, types=["expired", "killed"])
    _streams_open(srv, 1)
    with Controller(url, token=TOKEN) as ctl:
        ctl.create_snapshot("py", memory_mib=128)
        sid = ctl.spawn_sandboxes("py", timeout_s=0.3)[0]["id"]
    watch.until(lambda evs: len(evs) >= 2)
    expired, killed = watch.events
    assert expired.type == "expired" and expired["action"] == "kill"
    assert expired.sandbox_id == sid and killed.type == "killed"


def test_a_dead_vm_is_published_as_died(
    running: tuple[str, DaemonServer], driver: FakeDriver
) -> None:
    url, srv = running
    with Controller(url, token=TOKEN) as ctl:
        ctl.create_snapshot("py", memory_mib=128)
        sid = ctl.spawn_sandboxes("py")[0]["id"]
        watch = Collector(url, sandbox_id=sid)
        _streams_open(srv, 1)
        next(vm for vm in driver.vms if vm.id == sid).alive = False
        with pytest.raises(ControllerError):
            ctl.exec_command(sid, ["true"])
    watch.until(lambda evs: len(evs) >= 1)
    assert watch.types() == ["died"]


def _sse(url: str, query: str = "", headers: dict[str, str] | None = None) -> httpx.Response:
    """The status and headers of a raw ``GET /v1/events`` (the stream left unread)."""
    h = {"Authorization": f"Bearer {TOKEN}", **(headers or {})}
    with httpx.stream("GET", f"{url}/v1/events{query}", headers=h, timeout=5) as resp:
        if resp.status_code != 200:
            resp.read()
        return resp


def _frames(url: str, n: int, query: str = "", headers: dict[str, str] | None = None) -> list[str]:
    """The first ``n`` SSE frames (blank-line separated) of a raw stream."""
    h = {"Authorization": f"Bearer {TOKEN}", **(headers or {})}
    frames: list[str] = []
    with httpx.stream("GET", f"{url}/v1/events{query}", headers=h, timeout=5) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        buf = ""
        for text in resp.iter_text():
            buf += text
            while "\n\n" in buf and len(frames) < n:
                frame, buf = buf.split("\n\n", 1)
                frames.append(frame)
            if len(frames) >= n:
                return frames
    return frames


def test_reconnect_with_last_event_id_replays_what_was_missed(url: str) -> None:
    with Controller(url, token=TOKEN) as ctl:
        ctl.create_snapshot("py", memory_mib=128)
        first = _frames(url, 2, "?since=0&type=snapshot_created,created")
        assert first[0].startswith("id: ") and first[1].startswith("event: snapshot_created\nid: ")
        last_id = first[1].split("\n")[1][len("id: ") :]
        sid = ctl.spawn_sandboxes("py")[0]["id"]  # published while nobody listened
        again = _frames(url, 2, headers={"Last-Event-ID": last_id})
        assert again[0] == f"id: {last_id}"
        kind, event_id, data = again[1].split("\n")
        assert kind == "event: created" and int(event_id[4:]) == int(last_id) + 1
        assert json.loads(data[len("data: ") :])["sandbox_id"] == sid


@pytest.mark.parametrize(
    ("query", "headers", "message"),
    [
        ("?type=paused,paws", {}, "unknown event type 'paws'"),
        ("?type=", {}, "unknown event type ''"),
        ("?type=paused&type=resumed", {}, "given more than once"),
        ("?sandbox=sb-1", {}, "unknown query parameter 'sandbox'"),
        ("?since=-1", {}, ""),
        ("", {"Last-Event-ID": "abc"}, ""),
    ],
)
def test_a_bad_filter_or_id_is_a_400(
    url: str, query: str, headers: dict[str, str], message: str
) -> None:
    resp = _sse(url, query, headers)
    assert resp.status_code == 400 and message in resp.json()["error"]


def test_over_the_subscriber_cap_is_a_429_and_a_closed_stream_frees_its_slot(
    running: tuple[str, DaemonServer],
) -> None:
    url, srv = running
    bus_of(srv).max_subscribers = 1
    h = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream("GET", f"{url}/v1/events", headers=h, timeout=5) as first:
        assert first.status_code == 200
        resp = _sse(url)
        assert resp.status_code == 429 and "cap is 1" in resp.json()["error"]
    deadline = time.monotonic() + 5
    while (resp := _sse(url)).status_code == 429:  # the daemon sees the client go
        assert time.monotonic() < deadline, "the slot was not given back"
        time.sleep(0.05)
    assert resp.status_code == 200


def test_shutdown_with_open_streams_does_not_hang(settings: Settings, driver: FakeDriver) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    with daemon(settings, driver) as (url, srv):
        watch = Collector(url)
        with httpx.stream("GET", f"{url}/v1/events", headers=h, timeout=5) as resp:
            assert resp.status_code == 200
            _streams_open(srv, 2)
            started = time.monotonic()
            srv.should_exit = True
            assert b"id: " in resp.read()  # it ends (no ReadTimeout): the daemon closed it
    # daemon() joined the server thread: the lifespan ended too, well within uvicorn's
    # 30 s grace for open connections.
    assert time.monotonic() - started < 5
    watch.thread.join(5)
    assert isinstance(watch.error, ControllerError) and watch.error.status == 0


def _sigint_default() -> None:
    """In the child: Ctrl-C as in a terminal. A suite started in the background by a
    shell (``./dev.sh test &``) ignores SIGINT, and an ignored SIGINT is inherited:
    Python would then not turn it into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_cli_prints_one_line_per_event_and_exits_0_on_ctrl_c(url: str, tmp_path: Path) -> None:
    token_file = tmp_path / "cli-token"
    token_file.write_text(TOKEN)
    env = {**os.environ, "FORKD_URL": url, "FORKD_TOKEN_FILE": str(token_file)}
    with Controller(url, token=TOKEN) as ctl:
        ctl.create_snapshot("py", memory_mib=128)
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "forkd.cli", "events", "--since", "0", *extra],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=_sigint_default,
            )
            for extra in (
                ["--type", "snapshot_created", "--type", "created"],
                ["--json", "--type", "created"],
            )
        ]
        sid = ctl.spawn_sandboxes("py")[0]["id"]
    human = procs[0].stdout.readline()  # type: ignore[union-attr]
    created = procs[0].stdout.readline()  # type: ignore[union-attr]
    as_json = json.loads(procs[1].stdout.readline())  # type: ignore[union-attr]
    for proc in procs:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    assert "snapshot_created" in human and " py" in human
    assert created.split()[1] == "created" and sid in created and "fork_ms=" in created
    assert as_json["type"] == "created" and as_json["sandbox_id"] == sid


def test_every_type_is_documented() -> None:
    api = (Path(__file__).parents[2] / "docs" / "API.md").read_text()
    for kind in EVENT_TYPES:
        assert f"`{kind}`" in api, kind


def test_a_sandbox_whose_qemu_the_oom_killer_ended_died_of_oom(
    client: TestClient, tmp_path: Path
) -> None:
    """Its group's memory.events counts an OOM kill: ``died`` says ``oom``, not
    ``guest_exited``; one whose group counts none exited on its own."""
    client.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128})
    made = client.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 2}).json()
    services = client.app.state.services  # type: ignore[attr-defined]
    for info, kills in zip(made, (1, 0), strict=True):
        group = tmp_path / info["id"]
        group.mkdir()
        (group / "memory.events").write_text(f"oom 1\noom_kill {kills}\n")
        vm = services.vms[info["id"]]
        vm.cgroup = cgroups.Group("v2", (group,))
        vm.alive = False
        client.portal.call(services.vms.mark_dead, info["id"])  # type: ignore[union-attr]
    died = {
        info["id"]: [e["reason"] for e in services.events.held(info["id"]) if e["type"] == "died"]
        for info in made
    }
    assert died == {made[0]["id"]: ["oom"], made[1]["id"]: ["guest_exited"]}
