"""forkd doctor's conntrack check: the host's table must hold every sandbox's share."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd import doctor, limits
from forkd.vmm.jail import rulesets


def _sysctl(tmp_path: Path, value: str) -> Path:
    path = tmp_path / "nf_conntrack_max"
    path.write_text(value)
    return path


def test_a_table_too_small_for_the_default_cap_is_reported_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "default_max_sandboxes", lambda: 16)
    check = doctor._conntrack(_sysctl(tmp_path, "65535\n"))
    assert not check.ok and not check.fatal
    assert f"nf_conntrack_max={16 * rulesets.MAX_GUEST_CONNS}" in check.fix


def test_a_table_with_room_for_every_sandbox_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "default_max_sandboxes", lambda: 16)
    assert doctor._conntrack(_sysctl(tmp_path, str(16 * rulesets.MAX_GUEST_CONNS))).ok


def test_no_conntrack_module_yet_is_not_a_problem(tmp_path: Path) -> None:
    assert doctor._conntrack(tmp_path / "missing").ok
