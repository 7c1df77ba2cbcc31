"""Manifests, indexes and configs read as hostile JSON, and image references of every kind
parsed: what a user relies on when an image is malformed, deep, or named oddly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from forkd.errors import Invalid
from forkd.image_import import manifests, references
from forkd.image_import.manifests import Descriptor, ImageIndex, Platform
from forkd.oci.policy import RegistryPolicy
from forkd.oci.reference import Reference
from tests import oci_images as oi


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b"[" * (4 << 20),
        b'{"a":' * 40 + b"1" + b"}" * 40,
        b'"' + b'\\"' * (1 << 20),
        b'"\\' * (1 << 20),
    ],
)
def test_deep_or_unterminated_json_is_refused_quickly(body: bytes) -> None:
    started = time.monotonic()
    with pytest.raises(Invalid):
        manifests.load_json(body, "the manifest")
    assert time.monotonic() - started < 2.0


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    doc = {"a": "[[[[" * 1000 + '\\"{{{{', "b": [[[1]]]}
    assert manifests.load_json(json.dumps(doc).encode(), "x") == doc


def _desc(platform: str | None) -> Descriptor:
    p = Platform(*platform.split("/")) if platform else None
    return Descriptor(oi.OCI_MANIFEST, oi.digest_of(str(platform).encode()), 1, p)


def test_the_amd64_pick_prefers_the_baseline_variant_and_names_what_there_is() -> None:
    v3, v1 = _desc("linux/amd64/v3"), _desc("linux/amd64")
    arm = _desc("linux/arm64/v8")
    assert manifests.pick_platform(ImageIndex(oi.OCI_INDEX, (arm, v3, v1)), "x") == v1
    assert manifests.pick_platform(ImageIndex(oi.OCI_INDEX, (arm, v3)), "x") == v3
    lone = _desc(None)
    assert manifests.pick_platform(ImageIndex(oi.OCI_INDEX, (lone,)), "x") == lone
    with pytest.raises(Invalid, match="linux/arm64/v8, windows/amd64"):
        manifests.pick_platform(ImageIndex(oi.OCI_INDEX, (arm, _desc("windows/amd64"))), "x")


def test_a_config_is_read_as_docker_reads_it() -> None:
    ports: dict[str, dict[str, object]] = {"5432/tcp": {}, "22/tcp": {}}
    img = oi.image(
        [oi.layer({"a": b"a"})],
        {"Env": None, "Cmd": ["sh"], "User": "postgres", "ExposedPorts": ports},
    )
    parsed = manifests.parse_config(img.config.data, 1, "config")
    assert parsed.config.cmd == ("sh",) and parsed.config.env == ()
    assert parsed.config.user == "postgres"
    assert parsed.config.exposed_ports == ("22/tcp", "5432/tcp")
    assert parsed.diff_ids == (img.layers[0].diff_id,)
    for bad, words in (
        ({"Env": "A=1"}, "Env"),
        ({"Cmd": [1]}, "Cmd"),
        ({"Labels": {"a": 1}}, "Labels"),
        ({"WorkingDir": "a\0b"}, "WorkingDir"),
    ):
        with pytest.raises(Invalid, match=words):
            manifests.parse_config(oi.image([], bad).config.data, 0, "config")
    with pytest.raises(Invalid, match="linux/arm64"):
        manifests.parse_config(oi.image([], platform="linux/arm64").config.data, 0, "config")


def test_a_manifest_served_as_one_type_but_saying_another_is_refused() -> None:
    img = oi.image([oi.layer({"a": b"a"})])
    with pytest.raises(Invalid, match="served as"):
        manifests.parse_manifest(img.manifest.data, oi.DOCKER_MANIFEST, "m")
    assert manifests.parse_manifest(img.manifest.data, "", "m").config.digest == img.config.digest  # type: ignore[union-attr]


# ---------------------------------------------------------------------- references


POLICY = RegistryPolicy.of(["127.0.0.1:5000"])


def test_each_kind_of_reference_is_parsed(tmp_path: Path) -> None:
    odd = tmp_path / "a:b.tar"  # a path that itself holds a colon
    odd.write_bytes(b"")
    (tmp_path / "dir").mkdir()
    parse = lambda text: references.parse(text, POLICY)  # noqa: E731
    assert parse("127.0.0.1:5000/team/app:1@sha256:" + "a" * 64) == references.RegistryImage(
        Reference("127.0.0.1:5000", "team/app", "1", "sha256:" + "a" * 64)
    )
    assert parse("docker-daemon:myapp:1") == references.DaemonImage("myapp:1")
    assert parse(f"docker-archive:{odd}") == references.DockerArchive(odd, None)
    assert parse(f"docker-archive:{odd}:app:1") == references.DockerArchive(odd, "app:1")
    assert parse(f"oci-archive:{odd}:v1") == references.OciArchive(odd, "v1")
    assert parse(f"oci:{tmp_path}/dir:v1.0") == references.OciLayout(tmp_path / "dir", "v1.0")
    assert parse(f"oci:{tmp_path}/missing:v1") == references.OciLayout(
        tmp_path / "missing:v1",
        None,  # nothing exists: all of it is the path, reported missing
    )
    assert str(parse(f"oci:{tmp_path}/dir:v1.0")) == f"oci:{tmp_path}/dir:v1.0"


def test_short_names_follow_docker_hubs_rule_only_under_a_default_registry() -> None:
    with pytest.raises(Invalid, match="default-registry"):
        references.parse("python:3.12-slim", POLICY)
    hub = RegistryPolicy.of([], default="docker.io")
    got = references.parse("python:3.12-slim", hub)
    assert str(got) == "registry-1.docker.io/library/python:3.12-slim"


@pytest.mark.parametrize(
    "text",
    [
        "ftp://x/y",
        "docker-archive:",
        "oci:/tmp:bad tag!",
        "docker-daemon:UPPER",
        "a\nb",
        "docker-archive:/tmp:not a tag",
    ],
)
def test_a_malformed_reference_names_the_accepted_forms(text: str) -> None:
    with pytest.raises(Invalid):
        references.parse(text, POLICY)
    with pytest.raises(Invalid, match="oci-archive:PATH"):
        references.parse("ftp://x/y", POLICY)
