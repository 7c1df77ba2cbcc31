"""``forkd gateway``: the v1 API over many daemons (see :mod:`forkd.gateway`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from forkd.cli.daemon import connection_limits
from forkd.cli.extras import require_server
from forkd.cli.failures import fail
from forkd.cli.serve_options import (
    BodyIdleTimeoutOpt,
    HeaderTimeoutOpt,
    LogLevelOpt,
    MaxConnectionsOpt,
    MaxConnectionsPerAddressOpt,
)
from forkd.errors import ForkdError
from forkd.limits import (
    MAX_CONNECTIONS_PER_ADDRESS,
    REQUEST_BODY_IDLE_TIMEOUT_SECS,
    REQUEST_HEADER_TIMEOUT_SECS,
)

GatewayBindOpt = Annotated[str, typer.Option(envvar="FORKD_GATEWAY_BIND", help="HOST:PORT")]
NodeOpt = Annotated[
    list[str] | None,
    typer.Option("--node", envvar="FORKD_NODES", help="A daemon's URL; repeatable."),
]
NodesDnsOpt = Annotated[
    str | None,
    typer.Option(
        envvar="FORKD_NODES_DNS",
        help="A DNS name whose addresses are the daemons (a headless Service).",
    ),
]
NodePortOpt = Annotated[
    int, typer.Option(envvar="FORKD_NODE_PORT", help="The daemons' port (with --nodes-dns).")
]
NodeTokenFileOpt = Annotated[
    Path | None,
    typer.Option(envvar="FORKD_NODE_TOKEN_FILE", help="The daemons' bearer token."),
]
RegistryOpt = Annotated[
    str | None,
    typer.Option(
        envvar="FORKD_GATEWAY_REGISTRY",
        help="registry/repository snapshots move through between nodes.",
    ),
]
InsecureRegistryOpt = Annotated[
    bool,
    typer.Option(
        help="Ask the daemons for plain HTTP to that registry; each must list it with "
        "its own --insecure-registry (a listed one is plain HTTP anyway)."
    ),
]
ClientTokenFileOpt = Annotated[
    Path | None,
    typer.Option(envvar="FORKD_TOKEN_FILE", help="The token clients give the gateway."),
]
InsecureNoAuthOpt = Annotated[
    bool, typer.Option(help="No token for clients: anyone who reaches it forks VMs.")
]


def gateway(
    bind: GatewayBindOpt = "127.0.0.1:8890",
    node: NodeOpt = None,
    nodes_dns: NodesDnsOpt = None,
    node_port: NodePortOpt = 8889,
    node_token_file: NodeTokenFileOpt = None,
    registry: RegistryOpt = None,
    insecure_registry: InsecureRegistryOpt = False,
    token_file: ClientTokenFileOpt = None,
    insecure_no_auth: InsecureNoAuthOpt = False,
    header_timeout: HeaderTimeoutOpt = REQUEST_HEADER_TIMEOUT_SECS,
    body_idle_timeout: BodyIdleTimeoutOpt = REQUEST_BODY_IDLE_TIMEOUT_SECS,
    max_connections_per_address: MaxConnectionsPerAddressOpt = MAX_CONNECTIONS_PER_ADDRESS,
    max_connections: MaxConnectionsOpt = None,
    log_level: LogLevelOpt = "info",
) -> None:
    """Serve the v1 API over many forkd daemons: placement, routing, snapshots moved
    between them through an OCI registry. Stateless: run two behind a Service."""
    require_server("gateway")
    from forkd.controller.server import read_token
    from forkd.gateway.app import create_app, serve
    from forkd.gateway.nodes import NodeSet

    try:
        if not node and not nodes_dns:
            raise ForkdError("give the daemons: --node URL (repeatable) or --nodes-dns NAME")
        token = read_token(token_file)
        if token is None and not insecure_no_auth:
            raise ForkdError("give --token-file (clients' token), or --insecure-no-auth")
        if registry is not None:
            registry = _repository(registry)
        nodes = NodeSet(
            list(node or []), read_token(node_token_file), dns_name=nodes_dns, dns_port=node_port
        )
        limits = connection_limits(
            header_timeout, body_idle_timeout, max_connections_per_address, max_connections
        )
        app = create_app(nodes, token, registry, insecure_registry)
        serve(app, bind, log_level, limits, token=token)
    except ForkdError as exc:
        raise fail(str(exc)) from exc


def _repository(registry: str) -> str:
    """--registry as ``registry/repository``; a tag or a digest is refused."""
    from forkd.oci import reference

    parsed = reference.parse(registry)
    if parsed.tag or parsed.digest:
        raise ForkdError("--registry is registry/repository, without a tag")
    return f"{parsed.registry}/{parsed.repository}"


def register(app: typer.Typer) -> None:
    app.command("gateway")(gateway)
