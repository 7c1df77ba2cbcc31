"""Container image imports played in-process for the unit tests' daemon: an
:data:`~forkd.controller.services.images.Importer` that makes an imported image's
directory (as :func:`forkd.guest.container_image.assemble` lays it out, its disks
fake) and its layer blobs in a moment, from a table of known references.

Like a registry it answers only the references it holds (an unknown one is a 404),
reports steps as it goes and fetches a layer once: importing again, or a second
image on the same base layer, reuses what the blob cache holds.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from forkd import hosttools, paths
from forkd.controller.models import ImageImport
from forkd.controller.services.images import Imported, Progress
from forkd.errors import NotFound
from forkd.guest import container_image
from forkd.guest import image as images
from forkd.image_import.model import FetchedImage, ImageConfig, LayerBlob

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
BASE_LAYER = b"base layer: busybox\n" * 64  # shared by both images below

SERVICE = ImageConfig(
    env=("PATH=/bin", "GREETING=hello from the image"),
    working_dir="/srv",
    user="app",
    entrypoint=("serve",),
    cmd=("8080",),
    exposed_ports=("8080/tcp",),
)
TOOLS = ImageConfig(env=("PATH=/bin",), cmd=("sh",))


@dataclass(frozen=True)
class FakeSource:
    """An image a reference names: its config and its layers' bytes, bottom first."""

    config: ImageConfig
    layers: tuple[bytes, ...]


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def default_sources() -> dict[str, FakeSource]:
    """Two images on one base layer, under the kinds of reference a user gives."""
    service = FakeSource(SERVICE, (BASE_LAYER, b"the service's site\n" * 16))
    tools = FakeSource(TOOLS, (BASE_LAYER, b"more tools\n" * 16))
    return {
        "127.0.0.1:5000/team/web:1": service,
        "oci-archive:/srv/images/web.tar:1": service,
        "docker-daemon:tools:latest": tools,
    }


@dataclass
class FakeImporter:
    """An :data:`Importer`; ``calls`` holds each reference asked for, in order."""

    sources: dict[str, FakeSource] = field(default_factory=default_sources)
    calls: list[str] = field(default_factory=list)

    def __call__(self, req: ImageImport, progress: Progress) -> Imported:
        started = time.monotonic()
        self.calls.append(req.ref)
        source = self.sources.get(req.ref)
        if source is None:
            raise NotFound(f"image {req.ref}: no such repository or tag")
        blobs = paths.blobs_dir() / "sha256"
        blobs.mkdir(parents=True, exist_ok=True)
        fetched = reused = 0
        layers = []
        for n, data in enumerate(source.layers, 1):
            digest = _digest(data)
            blob = blobs / digest.removeprefix("sha256:")
            if blob.is_file():
                reused += len(data)
                progress(f"layer {n}/{len(source.layers)} {digest[:19]}: cached")
            else:
                blob.write_bytes(data)
                fetched += len(data)
                progress(f"layer {n}/{len(source.layers)} {digest[:19]}: {len(data)} bytes")
            layers.append(LayerBlob(digest, len(data), OCI_LAYER, blob))
        config_digest = _digest(json.dumps(source.config.to_json(), sort_keys=True).encode())
        manifest_digest = _digest(f"{config_digest} {[x.digest for x in layers]}".encode())
        done = FetchedImage(
            req.ref, manifest_digest, config_digest, source.config, tuple(layers), fetched, reused
        )
        return Imported(self._built(done, progress), done, time.monotonic() - started)

    @staticmethod
    def _built(done: FetchedImage, progress: Progress) -> images.Image:
        """The image directory of ``done`` (found, with one more reference, when built)."""
        name = container_image.image_name(done.config_digest)
        key = done.config_digest.removeprefix("sha256:")[-16:]
        image_dir = paths.images_dir() / f"{name}-{key}"
        meta_path = image_dir / "image.json"
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            if done.reference not in meta["references"]:
                meta["references"].append(done.reference)
                meta_path.write_text(json.dumps(meta))
            progress(f"image {name} is up to date ({key})")
            return images.find_image(str(image_dir))
        progress("flattening the image's layers into the root disk")
        image_dir.mkdir(parents=True)
        for disk in ("vmlinuz", "initrd.img", "rootfs.sqfs", container_image.RUNTIME_FILE):
            (image_dir / disk).write_bytes(b"fake " + disk.encode())
        meta = {
            "name": name,
            "key": key,
            "kind": container_image.KIND,
            "reference": done.reference,
            "references": [done.reference],
            "manifest_digest": done.manifest_digest,
            "config_digest": done.config_digest,
            "layers": [layer.digest for layer in done.layers],
            "config": done.config.to_json(),
            "template": {},
            "built_at_unix": int(time.time()),
        }
        meta_path.write_text(json.dumps(meta))
        progress(f"built image {name} ({key})")
        return images.find_image(str(image_dir))


def stand_in_boot_parts(monkeypatch: pytest.MonkeyPatch, where: Path) -> None:
    """What :func:`forkd.guest.container_image.assemble` makes an image's disks beside (the
    host tools, the kernel, its boot files, the Debian base, the runtime disk) as
    stand-ins under ``where``: a build then takes only what the test gives it."""
    from forkd.guest import image as images
    from forkd.guest import kernel, runtime

    monkeypatch.setattr(hosttools, "require", lambda tool: Path("/bin/true"))
    monkeypatch.setattr(kernel, "resolve", lambda _path: kernel.KernelPackage("linux-image", "1"))
    monkeypatch.setattr(images, "boot_files", lambda *_args: {"kernel": "vmlinuz"})
    monkeypatch.setattr(images, "base_tarball", lambda *_args: where / "base.tar")
    disk = where / "runtime.sqfs"
    disk.write_bytes(b"runtime")
    monkeypatch.setattr(runtime, "build", lambda *_args: disk)
    monkeypatch.setattr(runtime, "key", lambda _base: "0" * 16)
