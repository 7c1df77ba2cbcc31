"""Snapshots through a real OCI registry between two real daemons (Debian's docker-registry
on loopback): push, pull onto the other daemon, fork there; a branch taken on one node
forked on the other; a diff chain that travels whole; and every bad reference, host
mismatch and corrupt blob answered clearly with nothing left behind."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd import paths
from forkd.client import Controller, ControllerError, Sandbox, Snapshot
from forkd.oci import artifact, reference
from forkd.oci.registry import Registry
from tests.integration.conftest import Daemon, memory_digest
from tests.registry_server import RegistryServer, free_address

pytestmark = pytest.mark.integration

BLOB = "import hashlib, os\nblob = os.urandom(4 << 20)\nhashlib.sha256(blob).hexdigest()"


CLOSED = "127.0.0.1:1"  # listed with --insecure-registry: nothing listens there
PRIVATE = free_address()  # the registry that asks for a password, started by a test


@pytest.fixture(scope="module")
def registry(registry_address: str) -> Iterator[RegistryServer]:
    server = RegistryServer(address=registry_address)  # the suite's daemon lists it
    yield server
    server.stop()


@pytest.fixture(scope="module")
def other(registry: RegistryServer) -> Iterator[Daemon]:
    """A second daemon: another host, as far as snapshots go (its own state directory)."""
    root = Path(tempfile.mkdtemp(prefix="forkd-d2-", dir="/tmp"))
    d = Daemon(root)
    listed = [
        arg
        for address in (registry.address, PRIVATE, CLOSED)
        for arg in ("--insecure-registry", address)
    ]
    d.start(
        "--kill-on-exit", "--registry-auth", str(root / "docker.json"), *listed, "--show-host-paths"
    )  # memory_digest reads the pulled snapshots' files
    yield d
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def ctl2(other: Daemon) -> Iterator[Controller]:
    with Controller(other.url, token=other.token, timeout=600) as c:
        yield c


def _state(d: Daemon, ctl: Controller) -> tuple[set[str], list[str], set[str]]:
    """What a failed pull must not change: the tags, the files under the snapshot root,
    the image directories."""
    root = d.state_dir / "snapshots"
    images = {p.name for p in paths.images_dir().iterdir()}
    return {s["tag"] for s in ctl.list_snapshots()}, sorted(p.name for p in root.iterdir()), images


def _pull_refused(other: Daemon, ctl2: Controller, ref: str) -> ControllerError:
    """Pull ``ref`` as a tag nobody has: it must fail, and change nothing on the daemon."""
    before = _state(other, ctl2)
    with pytest.raises(ControllerError) as exc:
        ctl2.pull_snapshot(ref, "never")
    assert _state(other, ctl2) == before, ref
    return exc.value


def test_push_pull_and_fork_on_another_daemon(
    ctl: Controller, ctl2: Controller, api_template: str, registry: RegistryServer, other: Daemon
) -> None:
    ref = registry.ref("forkd/it", "py")
    first = Snapshot(api_template, controller=ctl).push(ref)
    assert first["encoding"] == "chunks" and first["bytes_uploaded"] > 10 << 20
    again = ctl.push_snapshot(api_template, ref)
    assert again["digest"] == first["digest"]  # the same snapshot is the same manifest
    assert again["layers_uploaded"] == 0 and again["bytes_uploaded"] < 100_000
    # The CLI pulls it on the other daemon, under another name.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "forkd.cli",
            "snapshot",
            "pull",
            ref,
            "--tag",
            "py-pulled",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=other.env(),
    )
    assert r.returncode == 0, r.stderr
    pulled = json.loads(r.stdout)
    assert pulled["tag"] == "py-pulled" and pulled["status"] == "ready"
    assert memory_digest(pulled) == memory_digest(ctl.snapshot_info(api_template))
    with Sandbox("py-pulled", controller=ctl2) as kid:
        out = kid.eval("open('/work/setup.txt').read().strip(), x + 1")
        assert out.error is None and out.result == "('ready', 42)"
    with pytest.raises(ControllerError) as exc:  # the tag is taken now
        ctl2.pull_snapshot(ref, "py-pulled")
    assert exc.value.status == 409


def test_a_branch_taken_on_one_node_forks_on_another(
    ctl: Controller, ctl2: Controller, sb: Sandbox, registry: RegistryServer
) -> None:
    ref = registry.ref("forkd/it", "py")
    Snapshot("py", controller=ctl).push(ref)  # the parent is in the repository
    if "py-pulled" not in {s["tag"] for s in ctl2.list_snapshots()}:
        ctl2.pull_snapshot(ref, "py-pulled")
    want = sb.eval(BLOB).result
    branch = sb.branch(tag="it-branch")
    pushed = branch.push(registry.ref("forkd/it", "branch"))
    assert pushed["encoding"] == "delta" and pushed["layers"] > 0
    # Only the pages that differ went up: 4 MiB of random bytes and the kernel's own.
    assert pushed["bytes_uploaded"] <= (4 << 20) * 1.05 + (2 << 20), pushed
    assert pushed["bytes_uploaded"] < pushed["bytes_total"] / 10
    pulled = Snapshot.pull(registry.ref("forkd/it", "branch"), controller=ctl2)
    assert pulled.tag == "it-branch"
    assert memory_digest(pulled.info) == memory_digest(ctl.snapshot_info("it-branch"))
    with Sandbox("it-branch", controller=ctl2) as kid:
        assert kid.eval("hashlib.sha256(blob).hexdigest()").result == want
    ctl.delete_snapshot("it-branch")  # its fork pool too: the suite's daemon is shared


def test_a_diff_chain_travels_whole(
    ctl: Controller, ctl2: Controller, sb: Sandbox, registry: RegistryServer
) -> None:
    sb.eval(BLOB)
    sb.branch(tag="it-d1", mode="diff")
    with Sandbox("it-d1", controller=ctl) as kid:
        want = kid.eval(BLOB.replace("blob =", "blob2 =").replace("(blob)", "(blob2)")).result
        kid.branch(tag="it-d2", mode="diff")
    ref = registry.ref("forkd/chain", "top")  # a repository with nothing in it yet
    pushed = ctl.push_snapshot("it-d2", ref)
    assert pushed["encoding"] == "delta"
    with Registry(reference.parse(ref), policy=registry.policy()) as reg:
        assert reg.has_manifest(pushed["base_digest"])  # its base went up first
    pulled = ctl2.pull_snapshot(ref)
    assert pulled["tag"] == "it-d2" and pulled["mode"] == "full"
    assert memory_digest(pulled) == memory_digest(ctl.snapshot_info("it-d2"))
    with Sandbox("it-d2", controller=ctl2) as kid:
        assert kid.eval("hashlib.sha256(blob2).hexdigest()").result == want
    ctl.delete_snapshot("it-d1", cascade=True)


def test_bad_references_change_nothing(
    ctl2: Controller, other: Daemon, registry: RegistryServer
) -> None:
    private = RegistryServer(user="ann", password="s3cret", address=PRIVATE)
    try:
        cases = [
            ("Not A Ref", 400),
            ("python:3.12", 400),  # no --default-registry: nothing is looked up
            ("127.0.0.1:2/forkd/it:py", 400),  # on loopback, not listed: never contacted
            (registry.ref("forkd/it", "no-such-tag"), 404),
            (registry.ref("forkd/nothing-here", "v1"), 404),
            (f"{CLOSED}/forkd/it:py", 502),
            (private.ref("forkd/it", "py"), 403),
        ]
        for ref, status in cases:
            refused = _pull_refused(other, ctl2, ref)
            assert refused.status == status, (ref, refused)
        with pytest.raises(ControllerError) as exc:
            ctl2.push_snapshot("never", registry.ref("forkd/it", "x"))
        assert exc.value.status == 404
        # With credentials in the daemon's docker config.json, the same registry answers.
        (other.root / "docker.json").write_text(
            json.dumps({"auths": {private.address: {"username": "ann", "password": "s3cret"}}})
        )
        ctl2.push_snapshot("py-pulled", private.ref("forkd/it", "py"))
        assert ctl2.pull_snapshot(private.ref("forkd/it", "py"), "py-private")["tag"]
        ctl2.delete_snapshot("py-private")
    finally:
        (other.root / "docker.json").unlink(missing_ok=True)
        private.stop()


def _republish(registry: RegistryServer, change: Any, tag: str) -> str:
    """The pushed ``py`` manifest, changed by ``change(manifest, config)``, under ``tag``."""
    ref = reference.parse(registry.ref("forkd/it", "py"))
    with Registry(ref, policy=registry.policy()) as reg:
        body, _ = reg.get_manifest("py")
        manifest = artifact.parse_manifest(body, "py")
        config = json.loads(reg.get_blob(manifest.config_digest, manifest.config_size))
        manifest = change(manifest, config) or manifest
        raw = artifact.config_bytes(config)
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        reg.put_blob(raw, digest)
        body = dataclasses.replace(manifest, config_digest=digest, config_size=len(raw)).to_bytes()
        reg.put_manifest(body, tag)
    return registry.ref("forkd/it", tag)


def test_a_host_that_cannot_restore_it_answers_409_before_writing(
    ctl: Controller, ctl2: Controller, other: Daemon, registry: RegistryServer, api_template: str
) -> None:
    ctl.push_snapshot(api_template, registry.ref("forkd/it", "py"))

    def foreign(_m: Any, config: dict[str, Any]) -> None:
        config["needs"].update(qemu="1.0", accel="kvm", cpu_flags=["no_such_flag"])

    ref = _republish(registry, foreign, "foreign")
    refused = _pull_refused(other, ctl2, ref)
    assert refused.status == 409
    assert "QEMU 1.0" in str(refused) and "KVM" in str(refused)


def test_a_corrupt_piece_leaves_nothing_behind(
    ctl: Controller, ctl2: Controller, other: Daemon, registry: RegistryServer, api_template: str
) -> None:
    ctl.push_snapshot(api_template, registry.ref("forkd/it", "py"))

    def swap_last_chunk(manifest: artifact.Manifest, _c: Any) -> artifact.Manifest:
        chunk = manifest.of_part("memory")[-1]  # fails late: most of the memory is written
        wrong = manifest.of_part("vmstate")[0].digest
        layers = tuple(
            dataclasses.replace(la, digest=wrong) if la == chunk else la for la in manifest.layers
        )
        return dataclasses.replace(manifest, layers=layers)

    ref = _republish(registry, swap_last_chunk, "corrupt")
    refused = _pull_refused(other, ctl2, ref)
    assert refused.status == 502 and "wrong content" in str(refused)


def test_a_snapshot_with_a_volume_travels_with_its_disk(
    ctl: Controller, ctl2: Controller, registry: RegistryServer, tmp_path: Path
) -> None:
    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / "hello.txt").write_text("from the volume\n")
    ctl.create_volume("it-vol", "64M", from_dir=str(tmp_path / "seed"))
    setup = ["echo written-by-the-template > /data/setup.txt"]
    ctl.create_snapshot(
        "it-vol-tpl", memory_mib=256, setup=setup, volumes=[{"name": "it-vol", "path": "/data"}]
    )
    try:
        ref = registry.ref("forkd/vol", "tpl")
        pushed = ctl.push_snapshot("it-vol-tpl", ref)
        assert pushed["layers"] > 0
        pulled = ctl2.pull_snapshot(ref)
        volumes = {v["name"] for v in ctl2.list_volumes()}
        assert "it-vol" in volumes  # made on the other daemon, with the disk as it was
        with Sandbox(pulled["tag"], controller=ctl2) as kid:
            run = kid.commands.run(["cat", "/data/hello.txt", "/data/setup.txt"])
            assert run.stdout.split() == ["from", "the", "volume", "written-by-the-template"]
            kid.commands.run(["sh", "-c", "echo child > /data/child.txt"])
        # The pull made a new volume; the pushed one is untouched on its daemon.
        with Sandbox("it-vol-tpl", controller=ctl) as kid:
            assert kid.commands.run(["ls", "/data"]).stdout.split() == [
                "hello.txt",
                "lost+found",
                "setup.txt",
            ]
        ctl2.delete_snapshot(pulled["tag"])
        ctl2.delete_volume("it-vol")
    finally:
        ctl.delete_snapshot("it-vol-tpl")
        ctl.delete_volume("it-vol")


def test_a_snapshot_claiming_more_than_the_disk_holds_is_refused_before_writing(
    ctl: Controller, ctl2: Controller, other: Daemon, registry: RegistryServer, api_template: str
) -> None:
    ctl.push_snapshot(api_template, registry.ref("forkd/it", "py"))

    def huge_volume(_m: Any, config: dict[str, Any]) -> None:
        config["volumes"] = [{"name": "huge", "path": "/data", "size_bytes": 1 << 40}]

    ref = _republish(registry, huge_volume, "huge")
    refused = _pull_refused(other, ctl2, ref)
    assert refused.status == 507 and "may need" in str(refused)


def test_pack_on_one_daemon_and_unpack_on_another(
    ctl: Controller, ctl2: Controller, api_template: str, other: Daemon, tmp_path: Path
) -> None:
    """Issue 36: the original forkd's pack and unpack, with real VMs: the template to a
    file (an OCI archive, no registry), made a snapshot again on another daemon, forked
    there with its warm state."""
    archive = tmp_path / "py.forkd-snapshot.tar"
    started = time.monotonic()
    size = ctl.export_snapshot(api_template, archive)
    packed_s = time.monotonic() - started
    assert size == archive.stat().st_size > 10 << 20
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "forkd.cli",
            "unpack",
            str(archive),
            "--tag",
            "py-unpacked",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=other.env(),
    )
    assert r.returncode == 0, r.stderr
    unpacked = json.loads(r.stdout)
    assert unpacked["tag"] == "py-unpacked" and unpacked["status"] == "ready"
    assert memory_digest(unpacked) == memory_digest(ctl.snapshot_info(api_template))
    with Sandbox("py-unpacked", controller=ctl2) as kid:
        out = kid.eval("open('/work/setup.txt').read().strip(), x + 1")
        assert out.error is None and out.result == "('ready', 42)"
    print(f"\npack of {api_template}: {size >> 20} MiB in {packed_s:.1f} s")
    ctl2.delete_snapshot("py-unpacked")
