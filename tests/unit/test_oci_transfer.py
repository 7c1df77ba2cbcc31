"""Push and pull of snapshot files through a real registry (Debian's docker-registry), no VM.

A snapshot here is files on disk, as a VM driver would leave them: memory
with data, zero pages and holes; a child whose memory differs in a few pages.
What is pulled must be byte for byte what was pushed, holes kept as holes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forkd.errors import NotFound, UpstreamError, UpstreamRefused
from forkd.oci import artifact, auth, image_files, pull, push, reference
from forkd.oci.policy import RegistryPolicy
from forkd.oci.registry import Registry, sha256
from forkd.vmm.qemu.argv import RUNTIME_CMDLINE, MachineConfig
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory_diff
from forkd.vmm.snapshot.files import SnapshotFiles, SnapshotMeta
from tests.registry_server import RegistryServer

PAGE = 4096
MIB = 8
SIZE = MIB << 20


@pytest.fixture(scope="module")
def server() -> Iterator[RegistryServer]:
    s = RegistryServer()
    yield s
    s.stop()


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    d = tmp_path / "images" / "python-0123456789abcdef"
    d.mkdir(parents=True)
    (d / "vmlinuz").write_bytes(os.urandom(300_000))
    (d / "initrd.img").write_bytes(os.urandom(100_000))
    (d / "rootfs.sqfs").write_bytes(os.urandom(artifact.IMAGE_PIECE + 5000))  # two pieces
    (d / "image.json").write_text(json.dumps({"name": "python", "key": "0123456789abcdef"}))
    return d


def _snapshot(root: Path, image_dir: Path, tag: str, pages: dict[int, bytes]) -> SnapshotFiles:
    d = root / tag
    d.mkdir(parents=True)
    (d / "vmstate").write_bytes(b"device state " * 100)
    with (d / "memory.bin").open("wb") as f:
        f.truncate(SIZE)
        for page, data in pages.items():
            f.seek(page * PAGE)
            f.write(data)
    machine = MachineConfig(
        MIB, 1, "tcg", image_dir / "vmlinuz", image_dir / "initrd.img", image_dir / "rootfs.sqfs"
    )
    meta = SnapshotMeta(
        machine=machine,
        image=None,
        created_at_unix=1_800_000_000,
        memory_bytes=SIZE,
        vmstate_bytes=1300,
        source_vm=None,
        parent_snapshot=None,
        capture_ms=0.0,
        pages_written=0,
        base_bytes_cloned=0,
        tag=tag,
        id=secrets.token_hex(8),
    )
    snapshot_files.write_meta(d, meta)
    return snapshot_files.load(d)


def _config() -> dict:
    return {
        "format": 1,
        "snapshot": {"tag": "t"},
        "machine": {},
        "needs": {},
        "image": {"name": "python", "key": "0123456789abcdef", "meta": {}},
    }


def _push(reg: Registry, snap: SnapshotFiles, tag: str, base: push.Base | None = None):
    """Push ``snap`` (its image beside it) as ``tag``, over ``base`` when given."""
    return push.push(snap, snap.machine.rootfs.parent, _config(), reg, tag, base, lambda _m: None)


PARENT_PAGES = {
    0: os.urandom(PAGE),
    1: b"\x00" * PAGE,  # a zero page written: stays a hole after the pull
    300: os.urandom(PAGE) * 1,
    301: b"a" * PAGE,
    1500: os.urandom(PAGE),
}


def _pull_memory(registry: Registry, ref: str, out: Path, local=lambda _d: None) -> pull.Downloads:
    remote = pull.open_remote(registry, ref)
    downloads = pull.Downloads(registry)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        pull.write_memory(registry, remote, downloads, fd, local)
    finally:
        os.close(fd)
    return downloads


def test_round_trip_keeps_every_byte_and_the_holes(server, tmp_path, image_dir) -> None:
    snap = _snapshot(tmp_path / "a", image_dir, "parent", PARENT_PAGES)
    ref = reference.parse(server.ref("forkd/rt", "v1"))
    with Registry(ref, policy=server.policy()) as reg:
        first = _push(reg, snap, "v1")
        again = _push(reg, snap, "v1")
        out = tmp_path / "pulled.bin"
        downloads = _pull_memory(reg, "v1", out)
    assert first.encoding == "chunks" and first.layers_uploaded > 0
    assert again.digest == first.digest  # the same snapshot is the same manifest
    assert again.layers_uploaded == 0  # nothing new: only the manifest is sent again
    assert again.bytes_uploaded < 10_000
    assert out.read_bytes() == snap.memory.read_bytes()
    assert out.stat().st_blocks * 512 <= 5 * PAGE * 2  # the data pages, the rest holes
    assert downloads.bytes < 200_000  # two compressed chunks, not 8 MiB


def test_a_child_goes_up_as_the_pages_that_differ(server, tmp_path, image_dir) -> None:
    parent = _snapshot(tmp_path / "a", image_dir, "parent", PARENT_PAGES)
    changed = {5: os.urandom(PAGE), 6: os.urandom(PAGE), 300: b"\x00" * PAGE, 2000: b"z" * PAGE}
    child = _snapshot(tmp_path / "a", image_dir, "child", {**PARENT_PAGES, **changed})
    ref = reference.parse(server.ref("forkd/delta", "parent"))
    with Registry(ref, policy=server.policy()) as reg:
        base = _push(reg, parent, "parent")
        with memory_diff.resolve(parent) as chain:
            over = push.Base(base.digest, "parent", chain)
            pushed = _push(reg, child, "child", over)
        assert pushed.encoding == "delta" and pushed.base_digest == base.digest
        assert pushed.memory_pages == len(changed)
        assert pushed.bytes_uploaded < len(changed) * PAGE + 20_000  # pages, index, manifest
        # A host without the parent pulls the chain; one with it pulls the pages only.
        cold = _pull_memory(reg, "child", tmp_path / "cold.bin")
        with memory_diff.resolve(parent) as chain:
            warm = _pull_memory(
                reg, "child", tmp_path / "warm.bin", lambda d: chain if d == base.digest else None
            )
    want = child.memory.read_bytes()
    assert (tmp_path / "cold.bin").read_bytes() == want
    assert (tmp_path / "warm.bin").read_bytes() == want
    assert warm.bytes < cold.bytes


def test_image_pieces_install_and_check(server, tmp_path, image_dir) -> None:
    snap = _snapshot(tmp_path / "a", image_dir, "s", PARENT_PAGES)
    ref = reference.parse(server.ref("forkd/img", "v1"))
    with Registry(ref, policy=server.policy()) as reg:
        _push(reg, snap, "v1")
        remote = pull.open_remote(reg, "v1")
        wanted = image_files.wanted(remote.manifest, artifact.IMAGE_FILES)
        assert image_files.differences(image_dir, wanted) == []
        installed = image_files.install(
            tmp_path / "other", remote.config, wanted, pull.Downloads(reg).fetch, {}
        )
    for name in artifact.IMAGE_FILES:
        assert (installed / name).read_bytes() == (image_dir / name).read_bytes()
    assert not [p for p in (tmp_path / "other").iterdir() if p.name.startswith(".")]
    (image_dir / "initrd.img").write_bytes(os.urandom(100_000))  # another build, same key
    assert image_files.differences(image_dir, wanted) == ["initrd.img differs from byte 0"]


def test_registry_errors_are_clear(server, tmp_path) -> None:
    missing = reference.parse(server.ref("forkd/none", "v1"))
    with (
        Registry(missing, policy=server.policy()) as reg,
        pytest.raises(NotFound, match="does not exist"),
    ):
        pull.open_remote(reg, "v1")
    closed = reference.parse("127.0.0.1:1/forkd/x:v1")
    listed = RegistryPolicy.of(["127.0.0.1:1"])
    with Registry(closed, policy=listed) as reg, pytest.raises(UpstreamError, match="unreachable"):
        pull.open_remote(reg, "v1")


def test_a_blob_of_the_wrong_content_is_refused(server, tmp_path, image_dir) -> None:
    snap = _snapshot(tmp_path / "a", image_dir, "s", PARENT_PAGES)
    ref = reference.parse(server.ref("forkd/tamper", "v1"))
    with Registry(ref, policy=server.policy()) as reg:
        _push(reg, snap, "v1")
        remote = pull.open_remote(reg, "v1")
        chunk = remote.manifest.of_part("memory")[0]
        other = remote.manifest.of_part("vmstate")[0]
        # A manifest naming a real blob in the wrong place, with the right size claimed.
        swapped = tuple(
            dataclasses.replace(la, digest=other.digest) if la == chunk else la
            for la in remote.manifest.layers
        )
        body = dataclasses.replace(remote.manifest, layers=swapped).to_bytes()
        reg.put_manifest(body, "evil")
        with pytest.raises(UpstreamError, match="wrong content"):
            _pull_memory(reg, "evil", tmp_path / "evil.bin")


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update(mediaType="application/vnd.docker.distribution.manifest.v2+json"),
        lambda m: m["config"].update(mediaType="application/vnd.oci.image.config.v1+json"),
        lambda m: m["layers"][0].update(mediaType="application/x-unknown"),
        lambda m: m["layers"][0].update(digest="sha256:nothex"),
        lambda m: m["layers"][0]["annotations"].update({artifact.LENGTH: str(1 << 40)}),
        lambda m: m["layers"][0]["annotations"].update({artifact.OFFSET: "-5"}),
        lambda m: m["config"].update(size=1 << 30),
        lambda m: m.update(layers="nope"),
    ],
)
def test_malformed_manifests_are_refused(change) -> None:
    layer = artifact.Layer(artifact.CHUNK_TYPE, sha256(b"x"), 10, "memory", 0, PAGE)
    good = artifact.Manifest(sha256(b"{}"), 2, (layer,)).to_bytes()
    assert artifact.parse_manifest(good, "r").layers == (layer,)
    data = json.loads(good)
    change(data)
    with pytest.raises(UpstreamError, match="not a forkd snapshot"):
        artifact.parse_manifest(json.dumps(data).encode(), "r")


def test_credentials_from_docker_config_and_refusal(tmp_path, image_dir) -> None:
    server = RegistryServer(user="ann", password="s3cret")
    try:
        ref = reference.parse(server.ref("forkd/private", "v1"))
        snap = _snapshot(tmp_path / "a", image_dir, "s", PARENT_PAGES)
        with (
            Registry(ref, policy=server.policy()) as reg,
            pytest.raises(UpstreamRefused, match="refused"),
        ):
            _push(reg, snap, "v1")
        wrong = auth.Credentials("ann", "nope")
        with (
            Registry(ref, policy=server.policy(), credentials=wrong) as reg,
            pytest.raises(UpstreamRefused),
        ):
            pull.open_remote(reg, "v1")
        right = auth.Credentials("ann", "s3cret")
        with Registry(ref, policy=server.policy(), credentials=right) as reg:
            pushed = _push(reg, snap, "v1")
            assert pull.open_remote(reg, "v1").digest == pushed.digest
    finally:
        server.stop()


def _pushed_volume(
    chunks: list[tuple[int, bytes]], name: str, size: int
) -> tuple[artifact.Manifest, Callable[[int], None]]:
    """A manifest carrying a volume of ``size`` bytes as ``chunks`` (what a push
    made of its disk), and what fills a new volume's disk from it, as a pull does."""
    from forkd.oci import volume_files

    layers = tuple(
        artifact.Layer(artifact.VOLUME_TYPE, sha256(d), len(d), "volume.0", off, len(d))
        for off, d in chunks
    )
    manifest = artifact.Manifest(sha256(b"{}"), 2, layers)
    config = {"volumes": [{"name": name, "path": "/data", "size_bytes": size}]}
    (vol,) = volume_files.wanted(manifest, config)
    contents = dict(zip(layers, (d for _, d in chunks), strict=True))

    def pieces(wanted: list[artifact.Layer]) -> list[tuple[artifact.Layer, bytes]]:
        return [(la, contents[la]) for la in wanted]

    return manifest, lambda fd: volume_files.write(manifest, vol, pieces, fd)


def test_volume_disks_travel_as_their_non_zero_chunks(tmp_path: Path) -> None:
    from forkd.oci import volume_files
    from forkd.vmm.volumes.disks import VolumeStore

    disk = tmp_path / "disk.raw"
    size = 64 << 20
    with disk.open("wb") as f:
        f.truncate(size)
        f.seek(5 << 20)
        f.write(b"data" * 1024)
        f.seek(9 << 20)
        f.write(bytes(1 << 20))  # written zeroes: no chunk either
        f.seek(size - PAGE)
        f.write(b"end!" * 1024)
    got = list(volume_files.chunks(disk))
    assert [off for off, _ in got] == [5 << 20, size - (1 << 20)]
    manifest, fill = _pushed_volume(got, "data", size)
    store = VolumeStore(tmp_path / "volumes")
    names = [store.create_filled("data", size, fill) for _ in range(2)]
    assert names[0] == "data" and names[1].startswith("data-")  # the name was taken
    base = store.base(names[1])
    assert base.read_bytes() == disk.read_bytes()
    assert base.stat().st_blocks * 512 <= 3 * PAGE * 2  # the rest are holes
    bad = {"volumes": [{"name": "../x", "path": "/data", "size_bytes": size}]}
    with pytest.raises(UpstreamError):
        volume_files.wanted(manifest, bad)
    outside = {"volumes": [{"name": "data", "path": "/data", "size_bytes": 1 << 20}]}
    with pytest.raises(UpstreamError):  # pieces past its end (and a size under the minimum)
        volume_files.wanted(manifest, outside)


def test_a_volume_of_a_size_off_page_bounds_travels_whole(tmp_path: Path) -> None:
    """Volumes are made of any size (``--size 300000000``): the last part-page too."""
    from forkd.oci import volume_files
    from forkd.vmm.volumes.disks import VolumeStore

    size = (16 << 20) + 1000
    disk = tmp_path / "odd.raw"
    with disk.open("wb") as f:
        f.truncate(size)
        f.seek(size - 10)
        f.write(b"last bytes")
    _, fill = _pushed_volume(list(volume_files.chunks(disk)), "odd", size)
    store = VolumeStore(tmp_path / "volumes")
    name = store.create_filled("odd", size, fill)
    assert store.base(name).read_bytes() == disk.read_bytes()


# -- a container image's runtime disk (config format 2) ------------------------------


@pytest.fixture
def container_dir(tmp_path: Path, image_dir: Path) -> Path:
    """An imported container image's directory: a recipe image's files and runtime.sqfs."""
    d = tmp_path / "images" / "oci-0123456789ab-fedcba9876543210"
    d.mkdir(parents=True)
    for name in artifact.IMAGE_FILES:
        os.link(image_dir / name, d / name)  # the same kernel and initramfs, one rootfs
    (d / artifact.RUNTIME_FILE).write_bytes(os.urandom(artifact.IMAGE_PIECE + 300))
    (d / "image.json").write_text(
        json.dumps({"name": "oci-0123456789ab", "key": "fedcba9876543210", "kind": "container"})
    )
    return d


def _container_config(names: tuple[str, ...] | list[str] | None = None) -> dict:
    carried = list(names if names is not None else (*artifact.IMAGE_FILES, artifact.RUNTIME_FILE))
    return {
        "format": 2,
        "snapshot": {"tag": "t"},
        "needs": {},
        "machine": {"cmdline": f"console=ttyS0 {RUNTIME_CMDLINE}"},
        "image": {
            "name": "oci-0123456789ab",
            "key": "fedcba9876543210",
            "meta": {},
            "files": carried,
        },
    }


def test_a_runtime_disk_travels_with_its_image_and_only_format_2_readers_take_it(
    server, tmp_path, container_dir, monkeypatch
) -> None:
    snap = _snapshot(tmp_path / "a", container_dir, "c", PARENT_PAGES)
    ref = reference.parse(server.ref("forkd/container", "v1"))
    with Registry(ref, policy=server.policy()) as reg:
        push.push(snap, container_dir, _container_config(), reg, "v1", None, lambda _m: None)
        remote = pull.open_remote(reg, "v1")
        names = artifact.image_file_names(remote.config)
        assert names == (*artifact.IMAGE_FILES, artifact.RUNTIME_FILE)
        wanted = image_files.wanted(remote.manifest, names)
        assert len(wanted[artifact.RUNTIME_FILE]) == 2  # in image pieces, like the rootfs
        downloads = pull.Downloads(reg)
        installed = image_files.install(
            tmp_path / "other", remote.config, wanted, downloads.fetch, {"kind": "container"}
        )
        # A forkd that reads format 1 only (every forkd before this one) refuses it by
        # its format, before it writes anything, instead of restoring a guest whose
        # second disk is missing.
        monkeypatch.setattr(artifact, "CONFIG_FORMATS", (1,))
        with pytest.raises(UpstreamError, match=r"config format 2, this forkd reads 1$"):
            pull.open_remote(reg, "v1")
    for name in names:
        assert (installed / name).read_bytes() == (container_dir / name).read_bytes()
    assert json.loads((installed / "image.json").read_text())["kind"] == "container"
    assert installed.name.startswith("oci-0123456789ab-fedcba9876543210-pulled-")


def test_a_recipe_snapshot_stays_format_1_for_older_readers() -> None:
    assert artifact.config_format(artifact.IMAGE_FILES) == 1
    assert artifact.config_format((*artifact.IMAGE_FILES, artifact.RUNTIME_FILE)) == 2
    assert artifact.image_file_names(_config()) == artifact.IMAGE_FILES
    body = artifact.config_bytes({**_config(), "memory": {"encoding": "chunks", "bytes": 4096}})
    assert artifact.parse_config(body, "r")["format"] == 1


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (_container_config(["vmlinuz", "initrd.img", "runtime.sqfs"]), "are not vmlinuz"),
        (_container_config([*artifact.IMAGE_FILES, "runtime.sqfs", "runtime.sqfs"]), "are not"),
        (_container_config([*artifact.IMAGE_FILES, "runtime.sqfs", "../x"]), "does not know"),
        (
            {**_container_config(), "image": {"name": "x", "key": "y", "files": "vmlinuz"}},
            "not a list of names",
        ),
        ({**_container_config(), "image": {"name": "x", "key": "y"}}, "no 'files'"),
        # A runtime disk carried for a guest not booted with one, and the reverse: what
        # an older forkd pushed of a container image (its machine named a host path).
        ({**_container_config(), "machine": {"cmdline": "console=ttyS0"}}, "not booted with"),
        (
            {**_config(), "machine": {"cmdline": f"a {RUNTIME_CMDLINE}", "runtime": "/x"}},
            "needs a runtime disk the artifact does not carry",
        ),
        ({**_container_config(artifact.IMAGE_FILES)}, "needs a runtime disk"),
        ({**_config(), "format": 3}, "config format 3, this forkd reads 1 and 2"),
        ({**_config(), "format": True}, "config format unknown"),
    ],
)
def test_configs_whose_image_files_do_not_fit_their_guest_are_refused(
    config: dict, words: str
) -> None:
    body = artifact.config_bytes({**config, "memory": {"encoding": "chunks", "bytes": 4096}})
    with pytest.raises(UpstreamError, match="not a forkd snapshot this forkd can read") as exc:
        artifact.parse_config(body, "r")
    assert words in str(exc.value)
    assert "../x" not in str(exc.value)  # what a registry wrote is not echoed


def test_an_image_file_the_config_does_not_name_is_refused() -> None:
    def piece(part: str) -> artifact.Layer:
        return artifact.Layer(artifact.IMAGE_FILE_TYPE, sha256(part.encode()), 4, part, 0, 4)

    manifest = artifact.Manifest(
        sha256(b"{}"), 2, tuple(piece(n) for n in (*artifact.IMAGE_FILES, artifact.RUNTIME_FILE))
    )
    assert len(image_files.wanted(manifest, (*artifact.IMAGE_FILES, artifact.RUNTIME_FILE))) == 4
    with pytest.raises(UpstreamError, match="an image file its config does not name"):
        image_files.wanted(manifest, artifact.IMAGE_FILES)


def test_files_another_image_here_has_are_linked_not_fetched(
    server, tmp_path, container_dir, image_dir
) -> None:
    """A host that has the kernel, initramfs and runtime disk (any container image of
    this forkd) fetches only the root disk of a pulled container image."""
    snap = _snapshot(tmp_path / "a", container_dir, "c", PARENT_PAGES)
    ref = reference.parse(server.ref("forkd/linked", "v1"))
    other = tmp_path / "other"
    neighbour = other / "oci-aaaaaaaaaaaa-1111111111111111"
    neighbour.mkdir(parents=True)
    for name in ("vmlinuz", "initrd.img", artifact.RUNTIME_FILE):
        os.link(container_dir / name, neighbour / name)
    (neighbour / "rootfs.sqfs").write_bytes(os.urandom(1000))
    (neighbour / "image.json").write_text("{}")
    with Registry(ref, policy=server.policy()) as reg:
        push.push(snap, container_dir, _container_config(), reg, "v1", None, lambda _m: None)
        remote = pull.open_remote(reg, "v1")
        wanted = image_files.wanted(remote.manifest, artifact.image_file_names(remote.config))
        downloads = pull.Downloads(reg)
        installed = image_files.install(other, remote.config, wanted, downloads.fetch, {})
    rootfs = (container_dir / "rootfs.sqfs").stat().st_size
    assert downloads.bytes == rootfs  # the root disk's pieces, nothing else
    for name in ("vmlinuz", "initrd.img", artifact.RUNTIME_FILE):
        assert (installed / name).stat().st_ino == (neighbour / name).stat().st_ino
    assert (installed / "rootfs.sqfs").read_bytes() == (container_dir / "rootfs.sqfs").read_bytes()
