from __future__ import annotations

from pathlib import Path

import pytest

from forkd.errors import ImageError
from forkd.guest.kernel import module_load_order


def _tree(tmp_path: Path, dep: str, builtin: str = "") -> Path:
    (tmp_path / "modules.dep").write_text(dep)
    (tmp_path / "modules.builtin").write_text(builtin)
    return tmp_path


def test_dependencies_come_first_and_once(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "kernel/virtio/virtio_mmio.ko: kernel/virtio/virtio_ring.ko kernel/virtio/virtio.ko\n"
        "kernel/virtio/virtio_ring.ko:\n"
        "kernel/virtio/virtio.ko: kernel/virtio/virtio_ring.ko\n"
        "kernel/block/virtio_blk.ko: kernel/virtio/virtio_ring.ko kernel/virtio/virtio.ko\n"
        "kernel/char/hw_random/virtio-rng.ko: kernel/virtio/virtio.ko\n",
    )
    order = module_load_order(root, ("virtio_mmio", "virtio_blk", "virtio-rng"))
    assert order == [
        "kernel/virtio/virtio_ring.ko",
        "kernel/virtio/virtio.ko",
        "kernel/virtio/virtio_mmio.ko",
        "kernel/block/virtio_blk.ko",
        "kernel/char/hw_random/virtio-rng.ko",
    ]


def test_builtin_modules_are_skipped(tmp_path: Path) -> None:
    root = _tree(tmp_path, "kernel/fs/squashfs.ko:\n", builtin="kernel/fs/overlay.ko\n")
    assert module_load_order(root, ("overlay", "squashfs")) == ["kernel/fs/squashfs.ko"]


def test_missing_module_is_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, "kernel/fs/squashfs.ko:\n")
    with pytest.raises(ImageError, match="virtio_net is neither built in nor shipped"):
        module_load_order(root, ("virtio_net",))
