"""A pulled image's record: what an import or a build of this forkd writes is kept (a
container image's config, digests, references), what no forkd writes is refused."""

from __future__ import annotations

from typing import Any

import pytest

from forkd.guest import pulled_image
from forkd.image_import.model import ImageConfig

CONFIG = ImageConfig(
    env=("PATH=/bin",),
    working_dir="/srv",
    user="app",
    cmd=("httpd",),
    exposed_ports=("8080/tcp",),
    labels={"a": "b"},
)
IMPORTED = {
    "name": "oci-cccccccccccc",
    "key": "0" * 16,
    "kind": "container",
    "reference": "oci-archive:/tmp/x.tar:1",
    "references": ["oci-archive:/tmp/x.tar:1"],
    "manifest_digest": "sha256:" + "d" * 64,
    "config_digest": "sha256:" + "c" * 64,
    "layers": ["sha256:" + "1" * 64],
    "config": CONFIG.to_json(),
    "kernel_release": "6.1.0",
    "rootfs": {"layers": 1},
    "template": {},
    "builder_version": 1,
    "built_at_unix": 1700000000,
    "build_secs": 2.5,
    "recipe_dir": "/home/someone",
}


def test_an_imported_images_record_keeps_what_forkd_reads() -> None:
    kept = pulled_image.checked(IMPORTED)
    assert ImageConfig.from_json(kept["config"]) == CONFIG
    for key in ("manifest_digest", "config_digest", "layers", "references", "built_at_unix"):
        assert kept[key] == IMPORTED[key]
    assert "recipe_dir" not in kept and kept["template"] == {}  # nothing a container has


def test_a_recipe_images_record_passes_with_its_build_time_checked() -> None:
    meta = {"name": "python", "key": "0" * 16, "template": {"vcpus": 2}, "built_at_unix": 5}
    assert pulled_image.checked(meta) == meta
    with pytest.raises(pulled_image.PulledImageInvalid, match="build time"):
        pulled_image.checked({**meta, "built_at_unix": float("nan")})


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"layers": ["sha256:../../etc"]}, "a layer of its image is not a sha256 digest"),
        ({"layers": ["sha256:" + "1" * 64] * 257}, "at most 256"),
        ({"config_digest": None}, "config_digest is not a sha256 digest"),
        ({"config": {"env": "PATH=/bin"}}, "Env is not a list"),
        ({"config": {"cmd": ["x" * ((64 << 10) + 1)]}}, "Cmd is not a string"),
        ({"config": {"labels": {"a": 1}}}, "a label is not a string"),
        ({"config": {"user": "a\0b"}}, "User is not a string"),
        ({"references": "oci:x"}, "references are not a short list"),
        ({"kind": "vm"}, "a kind this forkd does not know"),
        ({"build_secs": True}, "build_secs is not a number"),
    ],
)
def test_records_no_forkd_writes_are_refused(change: dict[str, Any], words: str) -> None:
    with pytest.raises(pulled_image.PulledImageInvalid, match=words):
        pulled_image.checked({**IMPORTED, **change})
    with pytest.raises(pulled_image.PulledImageInvalid):
        pulled_image.checked(["not", "an", "object"])
