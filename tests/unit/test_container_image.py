"""Guest images made from container images, without a kernel or a runtime (both faked):
a build is found by the name the image list shows, as a recipe image is, so a snapshot
can name it; the same image imported again finds its build and keeps it found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from forkd.guest import container_image
from forkd.guest import image as images
from forkd.image_import.model import ImageConfig, RootfsStats
from tests.unit.fake_images import stand_in_boot_parts

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache whose kernel, boot files, base and runtime disk are stand-ins."""
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path))
    stand_in_boot_parts(monkeypatch, tmp_path)
    return tmp_path


def write_rootfs(out: Path, _work: Path) -> RootfsStats:
    out.write_bytes(b"squashfs")
    return RootfsStats(layers=1, entries=1, file_bytes=8, image_bytes=8)


def build(reference: str) -> images.Image:
    identity: dict[str, Any] = {"reference": reference, "config_digest": DIGEST}
    return container_image.assemble(DIGEST, ImageConfig(cmd=("sh",)), identity, write_rootfs)


def test_an_imported_image_is_found_by_its_listed_name(cache: Path) -> None:
    built = build("reg.test/app:1")
    assert built.name == container_image.image_name(DIGEST) == "oci-" + "ab" * 6
    assert {i.name for i in images.list_images()} == {built.name}
    found = images.find_image(built.name)  # what POST /v1/snapshots {"image": name} looks up
    assert found.dir == built.dir and container_image.is_container(found)


def test_importing_it_again_finds_the_build_and_keeps_it_found(cache: Path) -> None:
    first = build("reg.test/app:1")
    (cache / "images" / f"{first.name}.json").unlink()  # as a build before names were kept
    again = build("docker-daemon:app:1")
    assert again.dir == first.dir
    assert again.meta["references"] == ["reg.test/app:1", "docker-daemon:app:1"]
    assert images.find_image(first.name).dir == first.dir
    images.remove(first.name, roots=[])
    with pytest.raises(Exception, match="not built"):
        images.find_image(first.name)
