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
import pytest
from fastapi.testclient import TestClient

from forkd import limits
from forkd.controller.app import create_app
from forkd.controller.settings import Settings
from forkd.launcher import free_port
from forkd.vmm.jail import cgroups
from tests.unit.conftest import TOKEN, serving
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


def fork(c: TestClient, n: int, tag: str = "py", **body: Any) -> httpx.Response:
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
    assert "cap of 3" in r.json()["error"] and "--max-sandboxes" in r.json()["error"]
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
    assert "needs 256 MiB" in r.json()["error"] and "512 of" in r.json()["error"]
    assert "--max-guest-memory" in r.json()["error"]
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
    r = httpx.post(f"{capped_server}/v1/snapshots", json={"tag": "py", "memory_mib": 128},
                   headers=AUTH, timeout=30)  # fmt: skip
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
    assert r.status_code == 429 and "512 of this daemon's 600 MiB" in r.json()["error"]
    # Once it is built, its template VM is gone and the room is free again.
    r = httpx.post(f"{url}/v1/sandboxes", json={"snapshot_tag": "py", "n": 2}, headers=AUTH)
    assert r.status_code == 201, r.text


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
