"""Which nodes hold an image: a template is built where its ``image`` already is.

Images live on the node that built, imported or was sent them; the gateway keeps
no list of its own and asks the nodes up (``GET /v1/images``) when it needs one.
"""

from __future__ import annotations

from typing import Any

from forkd import limits
from forkd.gateway.fleet_ops import FleetOps
from forkd.gateway.nodes import Node


def names_of(image: str) -> set[str]:
    """What an ImageInfo holding ``image`` (as ``POST /v1/snapshots`` takes it) may show
    among its name, ``NAME-KEY`` and references: a loaded image is named by ``NAME:TAG``
    or ``NAME`` (``:latest``) and recorded as ``loaded:NAME:TAG``."""
    names = {image, f"loaded:{image}"}
    last = image.rsplit("/", 1)[-1]
    if ":" not in last and "@" not in last:
        names.add(f"loaded:{image}:latest")
    return names


def is_build(info: Any, name: str) -> bool:
    """Whether the ImageInfo ``info`` is a build ``name`` names: any build of its name,
    or the one ``NAME-KEY`` (what a node's ``DELETE /v1/images/{name}`` removes)."""
    return isinstance(info, dict) and name in (
        info.get("name"),
        f"{info.get('name')}-{info.get('key')}",
    )


def holds(info: Any, image: str) -> bool:
    """Whether the ImageInfo ``info`` is what ``image`` names."""
    if not isinstance(info, dict):
        return False
    wanted = names_of(image)
    if any(is_build(info, name) for name in wanted):
        return True
    references = info.get("references")
    return isinstance(references, list) and not wanted.isdisjoint(
        r for r in references if isinstance(r, str)
    )


async def image_holders(ops: FleetOps, image: str) -> list[Node]:
    """The nodes up with room for a sandbox that hold ``image`` (a name, ``NAME-KEY``, a
    reference they imported, or a loaded image's ``NAME:TAG``), the roomiest first."""
    found = [
        node
        for node, infos in await listed_images(ops)
        if node.free(limits.DEFAULT_MEMORY_MIB) > 0 and any(holds(info, image) for info in infos)
    ]
    return sorted(found, key=lambda n: (-n.free(limits.DEFAULT_MEMORY_MIB), n.url))


async def listed_images(ops: FleetOps) -> list[tuple[Node, list[Any]]]:
    """Every node up and the images it lists (every build of each), as it answered."""
    found: list[tuple[Node, list[Any]]] = []
    for node, answer in await ops.ask_each("/v1/images"):
        try:
            listed = answer.json() if answer.status_code == 200 else []
        except ValueError:
            continue
        found.append((node, listed if isinstance(listed, list) else []))
    return found
