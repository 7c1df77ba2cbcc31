"""What an image import hands on: the image's config as forkd honours it, its layer blobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an OCI image config (``config`` of the config blob) forkd honours,
    as Docker does: the environment, the working directory, the default user, the
    command, the ports the image says it listens on."""

    env: tuple[str, ...] = ()  # "NAME=value", in the image's order
    working_dir: str = ""  # "" means /
    user: str = ""  # "", "name", "uid", "uid:gid" or "name:group"
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    exposed_ports: tuple[str, ...] = ()  # "5432/tcp", sorted
    labels: dict[str, str] = field(default_factory=dict)
    stop_signal: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "env": list(self.env),
            "working_dir": self.working_dir,
            "user": self.user,
            "entrypoint": list(self.entrypoint),
            "cmd": list(self.cmd),
            "exposed_ports": list(self.exposed_ports),
            "labels": dict(self.labels),
            "stop_signal": self.stop_signal,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageConfig:
        return cls(
            env=tuple(data.get("env") or ()),
            working_dir=str(data.get("working_dir") or ""),
            user=str(data.get("user") or ""),
            entrypoint=tuple(data.get("entrypoint") or ()),
            cmd=tuple(data.get("cmd") or ()),
            exposed_ports=tuple(data.get("exposed_ports") or ()),
            labels=dict(data.get("labels") or {}),
            stop_signal=str(data.get("stop_signal") or ""),
        )


@dataclass(frozen=True)
class LayerBlob:
    """One layer as fetched: the blob (gzip, zstd or plain tar) in the blob store,
    its digest checked, and the tar it holds checked against the config's diff_id."""

    digest: str  # "sha256:<hex>" of the blob as stored (compressed)
    size: int
    media_type: str
    path: Path
    diff_id: str = ""  # "sha256:<hex>" of the tar it holds, as the image's config says


@dataclass(frozen=True)
class FetchedImage:
    """An image whose manifest, config and layers are in the blob store, all checked."""

    reference: str  # what the user named, normalised ("127.0.0.1:5000/app:1", "oci-archive:/x.tar")
    manifest_digest: str
    config_digest: str  # the image id
    config: ImageConfig
    layers: tuple[LayerBlob, ...]  # the bottom layer first
    bytes_fetched: int  # read from the source into the store by this import
    bytes_reused: int  # of blobs the store held already


@dataclass(frozen=True)
class RootfsStats:
    """What flattening the layers produced."""

    layers: int
    entries: int  # in the merged tree
    file_bytes: int  # apparent sizes of its regular files, summed
    image_bytes: int  # the squashfs image's size
