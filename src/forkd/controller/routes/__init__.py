"""The routes of API v1 (docs/API.md): each translates a request model into one
service call and the service's answer into a response model.

One module per router; :data:`ROUTERS` is every one, in the order the app includes them."""

from forkd.controller.routes.discovery import discovery
from forkd.controller.routes.events import events
from forkd.controller.routes.files import files
from forkd.controller.routes.images import images
from forkd.controller.routes.network import network, secrets
from forkd.controller.routes.processes import processes
from forkd.controller.routes.sandboxes import sandboxes
from forkd.controller.routes.snapshots import snapshots
from forkd.controller.routes.volumes import volumes
from forkd.controller.routes.webhooks import webhooks
from forkd.controller.routes.workspaces import workspaces

ROUTERS = (
    discovery,
    snapshots,
    sandboxes,
    processes,
    files,
    volumes,
    images,
    workspaces,
    events,
    secrets,
    network,
    webhooks,
)

__all__ = ["ROUTERS"]
