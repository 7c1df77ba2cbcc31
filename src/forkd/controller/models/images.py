"""Images: a container image imported, and what the daemon says of its images."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from forkd.controller.models.common import IMAGE_REF, StrictBody


class ImageImport(StrictBody):
    ref: str = IMAGE_REF
    token: str | None = Field(
        None,
        max_length=8192,
        pattern=r"^[A-Za-z0-9._~+/-]+=*$",
        description="a bearer token for the registry; default: the daemon's docker config.json",
    )


class ImageConfigInfo(BaseModel):
    """What a container image sets, as Docker honours it."""

    env: list[str]
    working_dir: str
    user: str
    entrypoint: list[str]
    cmd: list[str]
    exposed_ports: list[str]
    labels: dict[str, str] = Field(default_factory=dict)


class ImageInfo(BaseModel):
    """A guest image: built from a recipe, or imported from a container image."""

    name: str
    key: str
    kind: Literal["recipe", "container"]
    names: list[str] = Field(
        default_factory=list,
        description="container: the local names (NAME:TAG) that find it, as an image of a "
        "snapshot, a DELETE or a GET: the tag it was built or loaded with, or the reference "
        "it was imported as",
    )
    references: list[str] = Field(
        default_factory=list, description="container: the references it was imported as"
    )
    id: str | None = Field(None, description="container: the config's digest (the image id)")
    digest: str | None = Field(None, description="container: the manifest's digest")
    layers: int | None = None
    size_bytes: int = Field(
        description="its own files on disk (shared ones, hard-linked: the runtime disk, the "
        "kernel and initramfs, not counted)"
    )
    layer_bytes: int | None = Field(None, description="container: its layers in the blob cache")
    shared_layer_bytes: int | None = Field(
        None, description="container: of layer_bytes, what another image uses too"
    )
    created_at_unix: int
    config: ImageConfigInfo | None = None
    used_by: list[str] = Field(default_factory=list, description="snapshots and VMs using it")
    bytes_fetched: int | None = Field(None, description="an import's answer: bytes it fetched")
    bytes_reused: int | None = Field(None, description="an import's answer: bytes it had")
    import_secs: float | None = Field(None, description="an import's answer: how long it took")


class ImportProgress(BaseModel):
    """A step of an image import (``progress`` events of POST /v1/images as SSE)."""

    message: str
