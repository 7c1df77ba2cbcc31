"""The gateway's connections to its nodes, over real sockets (a fake node and the gateway
each under uvicorn): streams its clients hold open have a pool of their own, so they
never hold up the gateway's own calls, and past that pool a stream is a 503, not a hang."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI
from starlette.responses import StreamingResponse

from forkd.gateway import proxy
from forkd.gateway.app import create_app
from forkd.gateway.nodes import NodeSet
from forkd.launcher import free_port
from tests.unit.conftest import serving

TOKEN = "gateway-pool-token"
STREAMS = 2


def _node() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/capacity")
    async def capacity() -> dict[str, object]:
        return {"node_id": "aaa", "snapshots": []}

    @app.post("/v1/snapshots", status_code=201)
    async def create_snapshot() -> dict[str, object]:
        return {"tag": "t", "status": "ready"}

    @app.get("/v1/sandboxes/{sandbox_id}/output")
    async def output(sandbox_id: str) -> StreamingResponse:
        async def forever() -> AsyncIterator[bytes]:
            yield b"first line\n"
            await asyncio.sleep(3600)  # a followed stream that stays quiet

        return StreamingResponse(forever(), media_type="text/plain")

    return app


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(proxy, "STREAM_CONNECTIONS", STREAMS)
    monkeypatch.setattr(proxy, "FORWARD_TIMEOUT", httpx.Timeout(None, connect=5, pool=0.5))
    node_port, gateway_port = free_port(), free_port()
    with serving(_node(), host="127.0.0.1", port=node_port):
        nodes = NodeSet([f"http://127.0.0.1:{node_port}"], "node-token")
        with serving(create_app(nodes, TOKEN), host="127.0.0.1", port=gateway_port):
            yield f"http://127.0.0.1:{gateway_port}"


def test_streams_held_open_never_hold_up_the_gateway_s_own_calls(gateway: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=gateway, headers=auth, timeout=10) as client:
        held = []
        try:
            for _ in range(STREAMS):  # every connection of the stream pool, held open
                stream = client.stream("GET", "/v1/sandboxes/sb-aaa-0001/output")
                lines = stream.__enter__().iter_lines()
                held.append((stream, lines))  # the reader kept: the stream stays open
                assert next(lines) == "first line"
            made = client.post("/v1/snapshots", json={"tag": "t"})  # the gateway's own call
            assert made.status_code == 201 and made.json()["tag"] == "t"
            one_more = client.get("/v1/sandboxes/sb-aaa-0001/output")
            assert one_more.status_code == 503  # said within the pool's wait, not hung
            assert "did not answer" in one_more.json()["error"]
        finally:
            for stream, _ in held:
                stream.__exit__(None, None, None)
