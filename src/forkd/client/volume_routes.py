"""Volumes: create, list, inspect, delete."""

from __future__ import annotations

import os
from pathlib import Path

from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.route_base import Call, RouteBase, no_answer, quote_segment, route


class VolumeCalls(RouteBase):
    """The JSON routes of volumes (:class:`~forkd.client.routes.Routes`)."""

    @route
    def create_volume(
        self, name: str, size: str | int = "1G", from_dir: str | os.PathLike[str] | None = None
    ) -> Call[JSONDict]:
        """``POST /v1/volumes``: an ext4 volume; ``from_dir`` (local) is copied into it.

        Example::

            ctl.create_volume("data", "2G", from_dir="./dataset")
            ctl.create_snapshot("py", volumes=[{"name": "data", "path": "/mnt/data"}])
        """
        content = _tar_directory(Path(from_dir)) if from_dir is not None else b""
        return self._json(
            "POST",
            "/v1/volumes",
            params={"name": name, "size": str(size)},
            content=content,
            headers={"Content-Type": "application/x-tar"},
            timeout=max(self.timeout, 600),
        )

    @route
    def list_volumes(self) -> Call[list[JSONDict]]:
        """``GET /v1/volumes``: each with ``size_bytes``, ``allocated_bytes``, ``used_by``."""
        return self._json("GET", "/v1/volumes")

    @route
    def volume_info(self, name: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/volumes/{quote_segment(name)}")

    @route
    def delete_volume(self, name: str) -> Call[None]:
        """``DELETE /v1/volumes/{name}``; 409 while a snapshot or sandbox uses it."""
        return self._request("DELETE", f"/v1/volumes/{quote_segment(name)}").then(no_answer)


def _tar_directory(path: Path) -> bytes:
    """The contents of a local directory as a gzip-compressed tar archive.

    Compressed, more fits in the daemon's 32 MiB body limit; the daemon tells
    gzip from plain tar by its first bytes (and always has).
    """
    import io
    import tarfile

    if not path.is_dir():
        raise ControllerError(0, f"{path} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for child in sorted(path.iterdir()):
            tar.add(child, arcname=child.name)
    return buf.getvalue()
