"""Per-sandbox metrics over the real app and a fake VM driver: what one sandbox uses
(host figures read by the daemon, guest figures checked before they are believed),
never waking a sleeping sandbox nor counting as its use; the host-wide list; the
Prometheus series labelled by sandbox and their cap; ``forkd metrics`` and ``forkd
top``; and the guest's ``stats`` op itself."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from forkd import limits
from forkd.client import Controller
from forkd.controller.settings import Settings
from tests.unit.conftest import Invoke, RecordingTransport, Server
from tests.unit.fakes import FakeDriver, FakeVM
from tests.unit.test_agent_files import _load

MIB = 1 << 20


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


def _vm(driver: FakeDriver, sandbox_id: str) -> FakeVM:
    return next(vm for vm in reversed(driver.vms) if vm.id == sandbox_id)


def test_a_running_sandbox_s_figures_from_the_host_and_its_guest(ctl: Controller, sid: str) -> None:
    m = ctl.sandbox_metrics(sid)
    assert m["sandbox_id"] == sid and m["state"] == "running"
    assert m["cpu"] == {"seconds": 1.5, "percent": 15.0, "count": 1}  # 1.5 s in 10 s
    assert m["memory"] == {
        "guest_total_bytes": 256 * MIB,
        "guest_used_bytes": 40 * MIB,
        "host_private_bytes": 64 * MIB,
        "host_proportional_bytes": 64 * MIB,
    }
    assert m["disk"] == {"used_bytes": 300 * MIB, "total_bytes": 2 << 30}
    assert m["network"] == {"rx_bytes": 1000, "tx_bytes": 2000}
    assert m["processes"] == 12 and m["wakes"] == 0 and m["evictions"] == 0


def test_cpu_percent_is_over_the_time_since_the_reading_before(
    ctl: Controller, sid: str, driver: FakeDriver
) -> None:
    assert ctl.sandbox_metrics(sid)["cpu"]["percent"] == 15.0
    _vm(driver, sid).cpu_used = 2.0
    assert ctl.sandbox_metrics(sid)["cpu"]["percent"] == 15.0  # under a second: as before
    time.sleep(1.05)
    _vm(driver, sid).cpu_used = 2.5  # 1 s of CPU in about a second since the first reading
    percent = ctl.sandbox_metrics(sid)["cpu"]["percent"]
    assert 80 < percent <= 100


def _listed(ctl: Controller, sandbox_id: str) -> dict[str, Any]:
    """Its SandboxInfo as the list has it (reading it alone would count as use)."""
    return next(s for s in ctl.list_sandboxes() if s["id"] == sandbox_id)


@pytest.mark.parametrize("how", ["pause", "hibernate"])
def test_reading_a_sleeping_sandbox_wakes_nothing_and_is_no_use(
    ctl: Controller, sid: str, how: str
) -> None:
    ctl.pause_sandbox(sid, hibernate=how == "hibernate")
    before = _listed(ctl, sid)["last_active_at"]
    time.sleep(0.01)
    m = ctl.sandbox_metrics(sid)
    assert m["state"] == ("hibernated" if how == "hibernate" else "paused")
    assert m["memory"]["guest_used_bytes"] is None and m["processes"] is None
    if how == "pause":  # its QEMU is there: the host's figures are
        assert m["memory"]["host_private_bytes"] == 64 * MIB and m["cpu"]["seconds"] == 1.5
    else:
        assert m["cpu"]["seconds"] is None and m["memory"]["host_private_bytes"] is None
    ctl.list_sandbox_metrics()
    assert _listed(ctl, sid)["state"] == m["state"]  # still asleep
    assert _listed(ctl, sid)["last_active_at"] == before


@pytest.mark.parametrize(
    "said",
    [
        {"memory": {"total_bytes": -1, "used_bytes": 0}},
        {"processes": "many"},
        {"network": {"rx_bytes": 1 << 70, "tx_bytes": 0}},
        {"mounts": {f"/m{i}": None for i in range(100)}},
        {"cpu": None},
    ],
)
def test_a_guest_s_answer_that_does_not_fit_is_dropped_not_believed(
    ctl: Controller, sid: str, driver: FakeDriver, said: dict[str, Any]
) -> None:
    _vm(driver, sid).guest_stats = said
    m = ctl.sandbox_metrics(sid)
    assert m["memory"]["guest_used_bytes"] is None and m["network"] is None
    assert m["memory"]["host_private_bytes"] == 64 * MIB  # the host's own reading stands


def test_the_list_has_every_sandbox_and_filters_by_id(
    ctl: Controller, server: Server, py: str
) -> None:
    ids = [s["id"] for s in ctl.spawn_sandboxes(py, n=3)]
    assert sorted(m["sandbox_id"] for m in ctl.list_sandbox_metrics()) == sorted(ids)
    assert [m["sandbox_id"] for m in ctl.list_sandbox_metrics(ids[1:2])] == ids[1:2]
    r = httpx.get(
        f"{server.url}/v1/sandboxes/metrics",
        params={"state": "running"},
        headers={"Authorization": f"Bearer {server.token}"},
    )
    assert r.status_code == 400
    r = httpx.get(
        f"{server.url}/v1/sandboxes/sb-nope/metrics",
        headers={"Authorization": f"Bearer {server.token}"},
    )
    assert r.status_code == 404


def test_prometheus_has_series_per_sandbox_up_to_the_cap(
    ctl: Controller, py: str, monkeypatch: pytest.MonkeyPatch, server: Server
) -> None:
    ids = [s["id"] for s in ctl.spawn_sandboxes(py, n=2)]
    text = httpx.get(
        f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.token}"}
    ).text
    for sid in ids:
        assert _sample(text, "forkd_sandbox_cpu_seconds_total", sid) == 1.5
        assert _sample(text, "forkd_sandbox_memory_host_private_bytes", sid) == 64 * MIB
    assert "forkd_sandbox_series_omitted 0" in text


def _sample(text: str, name: str, sandbox_id: str) -> float:
    prefix = f'{name}{{sandbox="{sandbox_id}"}} '
    return float(next(line for line in text.splitlines() if line.startswith(prefix)).split()[1])


def test_the_series_are_capped(
    settings: Any, driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    from forkd.controller.app import create_app
    from tests.unit.conftest import TOKEN

    monkeypatch.setattr(limits, "SANDBOX_SERIES_CAP", 1)
    with TestClient(
        create_app(settings, TOKEN, driver=driver), headers={"Authorization": f"Bearer {TOKEN}"}
    ) as c:
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128})
        c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 3})
        text = c.get("/metrics").text
    assert text.count("forkd_sandbox_cpu_seconds_total{") == 1
    assert "forkd_sandbox_series_omitted 2" in text


def test_forkd_metrics_and_top_print_the_figures(forkd: Invoke, sid: str) -> None:
    res = forkd("metrics", sid)
    assert res.exit_code == 0, res.output
    assert "64 MiB its own" in res.stdout and "40 of 256 MiB used" in res.stdout
    res = forkd("top", "--once", "--sort", "cpu")
    assert res.exit_code == 0, res.output
    assert sid in res.stdout and "1 with a VM: 64 MiB of host memory" in res.stdout
    res = forkd("top", "--once", "--sort", "disk")
    assert res.exit_code != 0 and "--sort must be memory or cpu" in res.output


stats = _load("forkd_stats_under_test", "forkd_stats.py")


def test_the_guest_s_stats_op_reads_this_machine() -> None:
    said = stats.op_stats({"paths": ["/", "/nonexistent"]})
    assert said["memory"]["total_bytes"] > said["memory"]["used_bytes"] > 0
    assert said["cpu"]["count"] >= 1 and said["cpu"]["busy_s"] > 0
    assert said["processes"] > 1 and said["disk"]["total_bytes"] > 0
    assert said["mounts"]["/nonexistent"] is None and said["mounts"]["/"] == said["disk"]
    assert set(said["network"]) == {"rx_bytes", "tx_bytes"}


@pytest.mark.parametrize("paths", ["/", ["relative"], [1], ["/"] * 65])
def test_the_stats_op_refuses_bad_paths(paths: Any) -> None:
    with pytest.raises(stats.RequestError):
        stats.op_stats({"paths": paths})


def test_only_the_asked_mounts_are_kept_and_a_gone_vm_s_readings_are_dropped(
    settings: Settings, driver: FakeDriver
) -> None:
    from fastapi.testclient import TestClient

    from forkd.controller.app import create_app
    from tests.unit.conftest import TOKEN

    with TestClient(
        create_app(settings, TOKEN, driver=driver), headers={"Authorization": f"Bearer {TOKEN}"}
    ) as c:
        assert c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 256}).status_code == 201
        sid = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
        # A guest that names 60 mount points nobody asked about, 4 KiB each.
        extra = {"/" + f"{i:02d}" * 2048: {"total_bytes": 1, "used_bytes": 1} for i in range(60)}
        _vm(driver, sid).guest_stats = {"mounts": extra}
        usage = c.app.state.services.usage  # type: ignore[attr-defined]
        assert c.get(f"/v1/sandboxes/{sid}/metrics").json()["processes"] == 12
        assert usage._guest[sid][1].mounts == {}  # none asked: none kept
        assert c.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True}).status_code == 200
        c.get("/v1/sandboxes/other-id-0000/metrics")  # any reading drops the gone VM's
        assert sid not in usage._guest and sid not in usage._cpu
