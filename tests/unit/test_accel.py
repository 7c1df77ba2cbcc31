from __future__ import annotations

from pathlib import Path

import pytest

from forkd import accel


@pytest.fixture
def kvm(tmp_path: Path) -> Path:
    dev = tmp_path / "kvm"
    dev.write_text("")
    return dev


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n")
    return p


def test_kvm_device_without_vmx_or_svm_means_tcg(tmp_path: Path, kvm: Path) -> None:
    choice = accel.choose("auto", kvm_dev=kvm, cpuinfo=_cpuinfo(tmp_path, "hypervisor"))
    assert choice.name == "tcg"
    assert "neither vmx nor svm" in choice.reason


@pytest.mark.parametrize("flag", ["vmx", "svm"])
def test_kvm_with_hardware_support(tmp_path: Path, kvm: Path, flag: str) -> None:
    assert accel.choose("auto", kvm_dev=kvm, cpuinfo=_cpuinfo(tmp_path, flag)).name == "kvm"


def test_no_kvm_device(tmp_path: Path) -> None:
    choice = accel.choose("auto", kvm_dev=tmp_path / "absent", cpuinfo=_cpuinfo(tmp_path, "vmx"))
    assert choice.name == "tcg"
    assert "does not exist" in choice.reason


def test_environment_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kvm: Path) -> None:
    monkeypatch.setenv("FORKD_ACCEL", "tcg")
    assert accel.choose(kvm_dev=kvm, cpuinfo=_cpuinfo(tmp_path, "vmx")).name == "tcg"
    monkeypatch.setenv("FORKD_ACCEL", "kvm")
    assert accel.choose(kvm_dev=tmp_path / "absent").name == "kvm"


def test_unknown_accelerator_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown accelerator 'hvf'"):
        accel.choose("hvf")
