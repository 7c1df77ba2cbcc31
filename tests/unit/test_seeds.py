"""Forks with a seed: child i gets seed + i, through every way a fork is made (a pooled
QEMU's claim, a restore), recorded in its info; out-of-range seeds change nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from forkd import limits
from forkd.client import Controller, ControllerError
from tests.unit.conftest import Server


@pytest.fixture
def ctl(server: Server) -> Iterator[Controller]:
    with Controller(server.url, token=server.token) as c:
        c.create_snapshot("py", memory_mib=128)
        yield c


def test_child_i_gets_seed_plus_i_and_says_so(ctl: Controller, server: Server) -> None:
    infos = ctl.spawn_sandboxes("py", n=3, seed=40)
    assert [i["seed"] for i in infos] == [40, 41, 42]
    by_id = {vm.id: vm for vm in server.driver.vms}
    assert [by_id[i["id"]].seed for i in infos] == [40, 41, 42]  # what the guest was given
    assert [s["seed"] for s in ctl.list_sandboxes() if s["id"] in by_id] == [40, 41, 42]
    assert ctl.spawn_sandboxes("py")[0]["seed"] is None  # no seed: fresh entropy


def test_a_seed_out_of_range_is_a_400_and_forks_nothing(ctl: Controller) -> None:
    for seed, n in ((-1, 1), (limits.MAX_SEED, 2), ("7", 1)):
        with pytest.raises(ControllerError) as exc:
            ctl.spawn_sandboxes("py", n=n, seed=seed)  # type: ignore[arg-type]
        assert exc.value.status == 400, (seed, n)
    assert ctl.list_sandboxes() == []
