"""What a client may name as an image's source: a tag for a loaded image in Docker's
grammar; an archive or layout only under a directory the operator allowed; a Docker
Engine only when one is configured."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from forkd.controller.settings import Settings
from forkd.errors import Invalid
from forkd.guest import container_image

if TYPE_CHECKING:
    from forkd.image_import.references import ImageSource


def check_loaded_tag(tag: str | None) -> str | None:
    """``tag`` when it is a name an image can be tagged with (Docker's grammar)."""
    if tag is None:
        return None
    from forkd.image_import.docker_engine import check_image_name

    return container_image.with_tag(check_image_name(tag, allow_digest=False))


def check_allowed(source: ImageSource, text: str, settings: Settings) -> None:
    """Refuse what the operator did not open to clients: an archive or layout outside
    every ``--image-archive-dir`` (the daemon would read it with its own rights: any host
    file that is a tar), a Docker Engine with ``--docker-host none``. Said before the
    path is looked at, so the answer tells nothing of what exists on the host."""
    from forkd.image_import import references

    if isinstance(source, references.DaemonImage) and settings.docker_host == "none":
        raise Invalid("docker-daemon: references are off on this daemon (--docker-host none)")
    if not isinstance(
        source, (references.DockerArchive, references.OciArchive, references.OciLayout)
    ):
        return
    kind = text.partition(":")[0]
    archive_dirs = settings.registries().image_archive_dirs
    if not archive_dirs:
        raise Invalid(
            f"{kind}: references are off on this daemon: send the archive instead with "
            "forkd image load PATH (POST /v1/images/load: no directory need be allowed), or "
            "the operator allows directories with --image-archive-dir (or --registry-policy)"
        )
    real = os.path.realpath(source.path)
    for allowed in archive_dirs:
        root = os.path.realpath(allowed)
        if real == root or real.startswith(root.rstrip("/") + "/"):
            return
    raise Invalid(
        f"{kind}: references must name a path under the daemon's --image-archive-dir; or "
        "send the archive with forkd image load PATH"
    )
