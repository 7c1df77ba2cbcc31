"""Admission: the daemon's caps on sandboxes, guest memory and children per request.

The real app over the fake VM driver. A request over a cap is a 429 before
anything starts: no VM, no registry row, no run directory, no id used up;
sandboxes other requests are still starting count, and template builds
count with their guest memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from fastapi.testclient import TestClient

from forkd import limits
from forkd.controller.app import create_app
from forkd.controller.services import host_memory
from forkd.controller.services.admission import AdmissionControl
from forkd.controller.settings import Settings
from forkd.errors import OverCapacity
from forkd.launcher import free_port
from forkd.vmm.jail import cgroups
from tests.unit.conftest import TOKEN, fake_meminfo, serving
from tests.unit.fake_cgroups import FakeCgroupFS
from tests.unit.fakes import FakeDriver

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def capped(settings: Settings, driver: FakeDriver) -> Iterator[TestClient]:
    """The app with at most 3 sandboxes and 600 MiB of guest memory."""
    settings.max_sandboxes = 3
    settings.max_guest_memory_mib = 600
    with TestClient(create_app(settings, TOKEN, driver=driver), headers=AUTH) as c:
        yield c


def template(c: TestClient, tag: str = "py", memory_mib: int = 128) -> None:
    r = c.post("/v1/snapshots", json={"tag": tag, "memory_mib": memory_mib})
    assert r.status_code == 201, r.text


def fork(c: TestClient, n: int, tag: str = "py", **body: Any) -> httpx2.Response:
    return c.post("/v1/sandboxes", json={"snapshot_tag": tag, "n": n, **body})


def seq(sandbox_id: str) -> int:
    return int(sandbox_id.rsplit("-", 1)[1])


def state(c: TestClient, settings: Settings, driver: FakeDriver) -> tuple[Any, ...]:
    """Everything a refused request must leave as it was."""
    run = sorted(p.name for p in settings.run_dir.iterdir())
    snaps = sorted(p.name for p in settings.snapshot_root.iterdir())
    return c.get("/v1/sandboxes").json(), c.get("/v1/snapshots").json(), len(driver.vms), run, snaps


# ------------------------------------------------------------------ caps


def test_a_fork_over_the_sandbox_cap_is_429_and_changes_nothing(
    capped: TestClient, settings: Settings, driver: FakeDriver
) -> None:
    template(capped)
    first = fork(capped, 2).json()
    before = state(capped, settings, driver)
    r = fork(capped, 2)
    assert r.status_code == 429, r.text
    assert "cap of 3 (--max-sandboxes) by 1" in r.json()["error"]
    assert state(capped, settings, driver) == before
    # No id was used up by the refused request.
    last = fork(capped, 1).json()[0]
    assert seq(last["id"]) == seq(first[-1]["id"]) + 1


def test_up_to_1000_children_in_one_request_as_the_original_more_is_400(
    client: TestClient, settings: Settings, driver: FakeDriver
) -> None:
    template(client)
    before = state(client, settings, driver)
    assert fork(client, limits.MAX_FORK_N + 1).status_code == 400  # outside the body's bounds
    assert state(client, settings, driver) == before
    # Admitted against the daemon's caps like any request (none here).
    r = fork(client, limits.MAX_FORK_N)
    assert r.status_code == 201, r.text
    assert len(r.json()) == limits.MAX_FORK_N


def test_guest_memory_counts_every_running_sandbox(
    capped: TestClient, settings: Settings, driver: FakeDriver
) -> None:
    settings.max_sandboxes = 10
    template(capped, "big", memory_mib=256)
    assert fork(capped, 2, "big").status_code == 201  # 512 of 600 MiB
    before = state(capped, settings, driver)
    r = fork(capped, 1, "big")
    assert r.status_code == 429
    said = r.json()["error"]
    assert "256 MiB more of guest memory would make 768" in said and "by 168" in said
    assert "(--max-guest-memory)" in said and "512 MiB are given" in said
    assert state(capped, settings, driver) == before


def test_a_template_build_over_the_memory_cap_is_429_and_leaves_no_snapshot(
    capped: TestClient, settings: Settings, driver: FakeDriver
) -> None:
    template(capped, "py", memory_mib=512)
    assert fork(capped, 1).status_code == 201  # 512 MiB in use
    before = state(capped, settings, driver)
    r = capped.post("/v1/snapshots", json={"tag": "more", "memory_mib": 128})
    assert r.status_code == 429, r.text
    assert "building snapshot 'more'" in r.json()["error"]
    assert state(capped, settings, driver) == before
    assert capped.get("/v1/snapshots/more/info").status_code == 404


def test_a_killed_sandbox_gives_its_room_back(capped: TestClient) -> None:
    template(capped)
    kids = fork(capped, 3).json()
    assert fork(capped, 1).status_code == 429
    assert capped.delete(f"/v1/sandboxes/{kids[0]['id']}").status_code == 204
    assert fork(capped, 1).status_code == 201


def test_a_failed_fork_gives_its_room_back(capped: TestClient, driver: FakeDriver) -> None:
    from forkd.errors import VMError

    template(capped)
    driver.fail_restore = VMError("QEMU exited")
    assert fork(capped, 3).status_code == 500
    driver.fail_restore = None
    assert fork(capped, 3).status_code == 201


# ------------------------------------------------------------------ in flight


def _post_all(url: str, bodies: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """POST every body at once, each from its own thread; the answers in order."""
    answers: list[httpx.Response | None] = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def post(i: int, path: str, body: dict[str, Any]) -> None:
        start.wait()
        answers[i] = httpx.post(url + path, json=body, headers=AUTH, timeout=30)

    threads = [threading.Thread(target=post, args=(i, *b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(a is not None for a in answers)
    return answers  # type: ignore[return-value]


@pytest.fixture
def capped_server(settings: Settings, driver: FakeDriver) -> Iterator[str]:
    """The capped app under a real uvicorn, so requests really run side by side."""
    settings.max_sandboxes = 3
    settings.max_guest_memory_mib = 600
    port = free_port()
    with serving(create_app(settings, TOKEN, driver=driver), host="127.0.0.1", port=port):
        yield f"http://127.0.0.1:{port}"


def test_two_requests_racing_for_the_last_slots_get_one_201_and_one_429(
    capped_server: str, driver: FakeDriver
) -> None:
    r = httpx.post(
        f"{capped_server}/v1/snapshots",
        json={"tag": "py", "memory_mib": 128},
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 201
    driver.restore_delay = 0.5  # both requests are in flight at once
    body = {"snapshot_tag": "py", "n": 2}
    answers = _post_all(capped_server, [("/v1/sandboxes", body), ("/v1/sandboxes", body)])
    assert sorted(a.status_code for a in answers) == [201, 429]
    refused = next(a for a in answers if a.status_code == 429)
    assert "2 are running or starting" in refused.json()["error"]  # the other one's, not started
    listed = httpx.get(f"{capped_server}/v1/sandboxes", headers=AUTH).json()
    assert len(listed) == 2 and len(driver.vms) == 1 + 2  # the template and two children


def test_a_template_build_in_flight_holds_its_guest_memory(
    capped_server: str, driver: FakeDriver
) -> None:
    url = capped_server
    r = httpx.post(f"{url}/v1/snapshots", json={"tag": "py", "memory_mib": 256}, headers=AUTH)
    assert r.status_code == 201
    driver.boot_delay = 1.0
    booting = threading.Event()
    boot = driver.boot

    async def boot_and_say(*args: Any, **kwargs: Any) -> Any:
        booting.set()
        return await boot(*args, **kwargs)

    driver.boot = boot_and_say  # type: ignore[method-assign]
    build = threading.Thread(
        target=httpx.post,
        args=(f"{url}/v1/snapshots",),
        kwargs={"json": {"tag": "tpl2", "memory_mib": 512}, "headers": AUTH, "timeout": 30},
    )
    build.start()
    assert booting.wait(10)  # the build is booting its 512 MiB template
    r = httpx.post(f"{url}/v1/sandboxes", json={"snapshot_tag": "py", "n": 1}, headers=AUTH)
    build.join(30)
    assert r.status_code == 429 and "512 MiB are given" in r.json()["error"]
    assert "cap of 600 MiB" in r.json()["error"]
    # Once it is built, its template VM is gone and the room is free again.
    r = httpx.post(f"{url}/v1/sandboxes", json={"snapshot_tag": "py", "n": 2}, headers=AUTH)
    assert r.status_code == 201, r.text


# ------------------------------------------------------------------ the host's real memory


@pytest.fixture
def by_memory(settings: Settings, driver: FakeDriver, meminfo: Path) -> Iterator[TestClient]:
    """The app as `forkd serve` makes it on that host, with a 512 MiB reserve."""
    settings.max_sandboxes = limits.default_max_sandboxes(4096)
    settings.max_guest_memory_mib = limits.overcommitted_guest_memory_mib(4.0, 4096)
    settings.memory_overcommit, settings.memory_reserve_mib = 4.0, 512
    with TestClient(create_app(settings, TOKEN, driver=driver), headers=AUTH) as c:
        yield c


def test_a_fork_whose_real_share_does_not_fit_is_429_saying_by_how_much(
    by_memory: TestClient, settings: Settings, driver: FakeDriver
) -> None:
    template(by_memory, memory_mib=256)
    before = state(by_memory, settings, driver)
    r = fork(by_memory, 11)  # 11 x 48 = 528 MiB; 1000 available less 512 reserved: 488
    assert r.status_code == 429, r.text
    said = r.json()["error"]
    assert "needs about 528 MiB of host memory (11 x 48 MiB" in said
    assert "488 MiB are left, short by 40" in said and "(--memory-reserve)" in said
    assert state(by_memory, settings, driver) == before
    assert fork(by_memory, 10).status_code == 201  # 480 fits


def test_guest_memory_larger_than_the_host_s_ram_is_admitted_when_its_real_share_fits(
    by_memory: TestClient, meminfo: Path
) -> None:
    fake_meminfo(meminfo, 4096, 3500)
    template(by_memory, memory_mib=2048)
    r = fork(by_memory, 3)  # 6 GiB of guest RAM on a 4 GiB host: 144 MiB really
    assert r.status_code == 201, r.text
    r = fork(by_memory, 6)  # 18 GiB given: over 4 x 4 GiB
    assert r.status_code == 429
    assert "(--memory-overcommit 4) by 2048" in r.json()["error"]


def test_a_template_build_counts_its_whole_guest_against_the_host(
    by_memory: TestClient, meminfo: Path
) -> None:
    r = by_memory.post("/v1/snapshots", json={"tag": "big", "memory_mib": 1024})
    assert r.status_code == 429, r.text
    assert "1024 MiB of a template's guest" in r.json()["error"]
    assert by_memory.get("/v1/snapshots/big/info").status_code == 404


class _VM:
    """What the memory watch reads of a VM."""

    def __init__(self, origin: str | None, anon_mib: float) -> None:
        self.origin = None if origin is None else Path(origin)
        self.anon_mib = anon_mib

    def resident_memory(self) -> dict[str, int]:
        return {"anon": int(self.anon_mib * (1 << 20))}


def test_a_snapshot_s_fork_estimate_is_what_its_settled_children_hold(meminfo: Path) -> None:
    now = [100.0]
    vms: dict[str, Any] = {}
    watch = host_memory.MemoryWatch(lambda: vms, clock=lambda: now[0])
    vms.update(
        {
            "a": _VM("/s/py", 30),
            "b": _VM("/s/py", 27),
            "c": _VM("/s/py", 40),
            "d": _VM("/s/other", 90),
        }
    )
    watch.sample()
    assert watch.fork_estimate_mib(Path("/s/py")) == limits.FORK_ESTIMATE_MIB  # not settled
    # Young VMs will take their estimate: 48 - 30, 48 - 27, 48 - 40; d is over it.
    assert watch.unsettled_mib() == 18 + 21 + 8
    now[0] += host_memory.SETTLE_SECS
    watch.sample()
    assert watch.fork_estimate_mib(Path("/s/py")) == 30  # the median of three
    assert watch.fork_estimate_mib(Path("/s/other")) == limits.FORK_ESTIMATE_MIB  # one child
    assert watch.unsettled_mib() == 0 and watch.sandboxes_mib() == 187
    del vms["a"]
    vms["e"] = _VM("/s/py", 10)
    watch.sample()  # read again within SAMPLE_SECS: kept
    assert watch.own_mib("a") == 30 and watch.own_mib("e") is None
    now[0] += host_memory.SAMPLE_SECS
    watch.sample()
    assert watch.own_mib("a") is None and watch.own_mib("e") == 10
    # Two settled siblings left: the estimate is the default again, which e will take.
    assert watch.unsettled_mib() == limits.FORK_ESTIMATE_MIB - 10


class _NoReclaim:
    """Reclaim that has nothing to take."""

    async def make_room(self, mib: int) -> list[str]:
        return []

    def busy_summary(self) -> str:
        return "reclaim is off"


def test_room_held_by_a_request_still_starting_counts_against_the_host(
    settings: Settings, meminfo: Path
) -> None:
    settings.memory_reserve_mib = 512
    vms: dict[str, Any] = {}
    control = AdmissionControl(settings, dict, _NoReclaim(), host_memory.MemoryWatch(lambda: vms))
    with control.admit("first", 5, 256):  # 5 x 48 = 240 of the 488 left
        with (
            pytest.raises(OverCapacity, match="240 MiB that sandboxes still starting"),
            control.admit("second", 6, 256),  # 288 more: over
        ):
            pass
        with control.admit("third", 5, 256):
            assert control.starting_mib() == 480
    with control.admit("again", 10, 256):  # the room is given back
        pass


def test_this_host_s_defaults_let_100_forks_of_a_256_mib_template_run() -> None:
    """As the issue asks of a 24 GiB host: 25 GiB of guest RAM admitted, 100 sandboxes."""
    host = 24 * 1024
    assert limits.default_memory_reserve_mib(host) == 1536
    assert limits.default_max_sandboxes(host) == 480 >= 100
    assert limits.overcommitted_guest_memory_mib(limits.MEMORY_OVERCOMMIT, host) >= 100 * 256
    assert host - limits.default_memory_reserve_mib(host) > 100 * limits.FORK_ESTIMATE_MIB
    assert limits.default_max_sandboxes(2048) == 21  # a small host: (2048 - 1024) / 48
    assert limits.default_max_sandboxes(1 << 20) == limits.MAX_SANDBOXES_CEILING


# ------------------------------------------------------------------ memory_limit_mib


@pytest.fixture
def with_cgroups(
    settings: Settings, driver: FakeDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    fs = FakeCgroupFS(tmp_path / "cgroupfs", v2=True).install(monkeypatch)
    settings.cgroup_root, settings.cgroup_parent = fs.root, "forkd"
    with TestClient(create_app(settings, TOKEN, driver=driver), headers=AUTH) as c:
        yield c


def test_a_memory_limit_below_what_the_sandbox_needs_is_400_and_changes_nothing(
    with_cgroups: TestClient, settings: Settings, driver: FakeDriver
) -> None:
    template(with_cgroups)
    before = state(with_cgroups, settings, driver)
    least = cgroups.min_memory_limit_mib("tcg")
    r = fork(with_cgroups, 1, memory_limit_mib=least - 1)
    assert r.status_code == 400
    assert f"the least is {least}" in r.json()["error"]
    assert state(with_cgroups, settings, driver) == before
    assert driver.restore_kwargs == []


def test_the_asked_memory_limit_goes_to_the_vms_cgroup(
    with_cgroups: TestClient, driver: FakeDriver
) -> None:
    template(with_cgroups)
    assert fork(with_cgroups, 1, memory_limit_mib=200).status_code == 201
    assert fork(with_cgroups, 1).status_code == 201
    placements = [kw["cgroup"] for kw in driver.restore_kwargs]
    assert [p.memory_limit_mib for p in placements] == [200, None]  # None: RAM + overhead
    assert all(p.hierarchy.version == "v2" for p in placements)
