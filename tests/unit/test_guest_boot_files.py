"""An image's kernel and initramfs: made once per kernel and initramfs in
``<cache>/boot/<key>/`` and hard-linked into every image built with them, rebuilt when
an input changes, and nothing cached when making them fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd import hosttools
from forkd.guest import guest_files, initramfs, kernel
from forkd.guest import image as images

KPKG = kernel.KernelPackage("linux-image-6.1.0-57-amd64", "6.1.192-3")


class FakeKernelTools:
    """kernel.fetch, kernel.unpack and initramfs.build without a .deb, counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.unpacked = 0
        self.fail_initramfs = False
        busybox = tmp_path / "busybox"
        busybox.write_bytes(b"static busybox")
        monkeypatch.setattr(hosttools, "require_static_busybox", lambda: busybox)
        monkeypatch.setattr(kernel, "fetch", lambda pkg, downloads: tmp_path / "kernel.deb")
        monkeypatch.setattr(kernel, "unpack", self.unpack)
        monkeypatch.setattr(initramfs, "build", self.initramfs)

    def unpack(self, deb: Path, dest: Path) -> kernel.UnpackedKernel:
        self.unpacked += 1
        (dest / "boot").mkdir(parents=True)
        vmlinuz = dest / "boot" / "vmlinuz-6.1.0-57-amd64"
        vmlinuz.write_bytes(b"kernel image")
        return kernel.UnpackedKernel(vmlinuz, "6.1.0-57-amd64", dest / "lib" / "modules")

    def initramfs(self, unpacked: kernel.UnpackedKernel, work: Path, out: Path) -> list[str]:
        if self.fail_initramfs:
            raise RuntimeError("cpio failed")
        out.write_bytes(b"initramfs archive")
        return ["kernel/virtio/virtio.ko"]


def make(cache: Path, name: str, kpkg: kernel.KernelPackage = KPKG) -> tuple[Path, dict]:
    staging = cache / f"staging-{name}"
    out = cache / "images" / name
    staging.mkdir(parents=True)
    out.mkdir(parents=True)
    return out, images.boot_files(kpkg, cache, staging, out, lambda _msg: None)


def test_the_kernel_is_unpacked_once_and_linked_into_each_image(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tools = FakeKernelTools(monkeypatch, tmp_path)
    first, meta = make(tmp_path, "a")
    second, meta_again = make(tmp_path, "b")
    assert tools.unpacked == 1
    assert (
        meta
        == meta_again
        == {
            "kernel_package": KPKG.key,
            "kernel_release": "6.1.0-57-amd64",
            "kernel_format": "bzimage",  # b"kernel image" holds no xz-packed ELF
            "modules": ["kernel/virtio/virtio.ko"],
        }
    )
    for name in ("vmlinuz", "initrd.img"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
        assert (first / name).stat().st_ino == (second / name).stat().st_ino  # one copy
    assert (first / "vmlinuz").read_bytes() == b"kernel image"
    # An image removed takes its links only: the next image still finds the pair.
    for name in ("vmlinuz", "initrd.img"):
        (first / name).unlink()
    make(tmp_path, "c")
    assert tools.unpacked == 1


def test_another_kernel_or_stage_one_makes_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tools = FakeKernelTools(monkeypatch, tmp_path)
    make(tmp_path, "a")
    make(tmp_path, "b", kernel.KernelPackage(KPKG.name, "6.1.193-1"))
    assert tools.unpacked == 2
    real = guest_files.GuestFile.read
    monkeypatch.setattr(guest_files.GuestFile, "read", lambda file: real(file) + b"\n# changed")
    make(tmp_path, "c")
    assert tools.unpacked == 3
    assert len(list((tmp_path / "boot").iterdir())) == 3


def test_a_failed_make_caches_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tools = FakeKernelTools(monkeypatch, tmp_path)
    tools.fail_initramfs = True
    with pytest.raises(RuntimeError, match="cpio failed"):
        make(tmp_path, "a")
    assert list((tmp_path / "boot").iterdir()) == []  # no staging left, no half pair
    tools.fail_initramfs = False
    out, _ = make(tmp_path, "b")
    assert (out / "initrd.img").read_bytes() == b"initramfs archive"
    assert tools.unpacked == 2
