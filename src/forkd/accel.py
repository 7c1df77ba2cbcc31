"""Choose the QEMU accelerator: KVM only where it can really run a Linux guest.

``/dev/kvm`` opening is not enough: on nested hosts without hardware
virtualisation a Linux guest crawls and then dies with an emulation failure.
So ``auto`` picks KVM only when ``/dev/kvm`` is read-writable *and* the CPU
advertises ``vmx`` or ``svm``; otherwise TCG. ``FORKD_ACCEL`` overrides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

VALID = ("auto", "kvm", "tcg")


@dataclass(frozen=True)
class AccelChoice:
    name: Literal["kvm", "tcg"]
    reason: str


def _cpu_flags(cpuinfo: Path) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def choose(
    requested: str | None = None,
    *,
    kvm_dev: Path = Path("/dev/kvm"),
    cpuinfo: Path = Path("/proc/cpuinfo"),
) -> AccelChoice:
    """Resolve ``requested`` (or ``FORKD_ACCEL``, default ``auto``) to kvm or tcg."""
    want = (requested or os.environ.get("FORKD_ACCEL") or "auto").strip().lower()
    if want not in VALID:
        raise ValueError(f"unknown accelerator {want!r}: use one of {', '.join(VALID)}")
    if want == "tcg":
        return AccelChoice("tcg", "requested explicitly")
    if want == "kvm":
        return AccelChoice("kvm", "requested explicitly")
    if not kvm_dev.exists():
        return AccelChoice("tcg", f"{kvm_dev} does not exist")
    if not os.access(kvm_dev, os.R_OK | os.W_OK):
        return AccelChoice("tcg", f"{kvm_dev} is not read-writable by this user")
    flags = _cpu_flags(cpuinfo)
    if not flags & {"vmx", "svm"}:
        return AccelChoice(
            "tcg",
            f"{kvm_dev} opens but the CPU flags show neither vmx nor svm "
            "(nested virtualisation without hardware support cannot run a Linux guest)",
        )
    return AccelChoice("kvm", f"{kvm_dev} is usable and the CPU has hardware virtualisation")
