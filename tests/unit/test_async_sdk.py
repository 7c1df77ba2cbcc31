"""The asyncio SDK against the real app under uvicorn (fake VM driver): the same
lifecycle as the sync SDK's test (template, fork, exec, eval, files, branch, fork the
branch, delete), and the same bytes on the wire as the sync client, route by route."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest

from forkd.client import (
    AsyncController,
    AsyncSandbox,
    AsyncSnapshot,
    Controller,
    ControllerError,
)
from tests.unit.conftest import Server


def test_async_lifecycle(server: Server) -> None:
    async def lifecycle() -> None:
        async with AsyncController(server.url, token=server.token) as ctl:
            snap = await AsyncSnapshot.create(
                "tpl", controller=ctl, memory_mib=256, warmup="x = 41"
            )
            assert snap.tag == "tpl" and snap.info["memory_mib"] == 256
            assert snap.branched_from is None and snap.pause_ms is None

            kids = await snap.fork(3, timeout_secs=60)
            assert [k.id for k in kids] == [s["id"] for s in await ctl.list_sandboxes()]
            assert (await kids[2].eval("x + 1")).result == "42"
            run = await kids[2].commands.run("echo hi")
            assert run.ok and isinstance(run.stdout, str)
            await kids[2].files.write("/tmp/a.txt", "hello")
            assert await kids[2].files.read("/tmp/a.txt") == b"hello"

            branch = await kids[0].branch()
            assert branch.tag == f"branch-{kids[0].id}-1" and branch.branched_from == kids[0].id
            assert isinstance(branch.pause_ms, int)
            assert (await kids[0].refresh())["branch_count"] == 1
            grandkids = await branch.fork(2)
            assert {g.snapshot_tag for g in grandkids} == {branch.tag}
            assert (await branch.refresh())["parent_tag"] == "tpl"

            async with await AsyncSandbox.connect(kids[1].id, controller=ctl) as same:
                assert (await same.ping())["pong"] is True
            assert same.killed  # killed at the end of the block
            await branch.delete()
            with pytest.raises(ControllerError) as exc:
                await ctl.snapshot_info(branch.tag)
            assert exc.value.status == 404

    asyncio.run(lifecycle())


def test_async_streams_background_process_and_events(server: Server) -> None:
    async def streams() -> None:
        async with AsyncController(server.url, token=server.token) as ctl:
            await AsyncSnapshot.create("tpl", controller=ctl, memory_mib=128)
            # since=0: the events the daemon holds first, so the fork's is there however
            # late the stream opens on a loaded host
            stream = ctl.events(types="created", since=0)
            assert isinstance(stream, AsyncGenerator)  # what aclosing closes
            async with contextlib.aclosing(stream) as events:
                first = asyncio.ensure_future(anext(events))
                sb = await AsyncSandbox.create("tpl", controller=ctl)
                created = await asyncio.wait_for(first, 10)
            assert created.type == "created" and created.sandbox_id == sb.id
            async with sb:
                handle = await sb.commands.start(["printf", "one"])
                result = await handle.wait()
                assert result.exit_code == 0 and "one" in result.stdout
                again = await sb.commands.connect(handle.pid)
                kinds = [ev.kind async for ev in again.events()]
                assert kinds[-1] == "exit" and again.stdout == result.stdout
                assert (await sb.preview_url(8000)).startswith(f"{server.url}/v1/preview/")
                assert sb.get_url(8000, "/x") == f"{server.url}/v1/sandboxes/{sb.id}/ports/8000/x"

    asyncio.run(streams())


# Each route, called the same way on both clients: the requests must be identical.
CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("create_snapshot", ("py",), {"memory_mib": 256, "setup": "pip install x"}),
    (
        "create_snapshot",
        ("pg",),
        {
            "image": "127.0.0.1:5000/pg:16",
            "start": True,
            "ready_port": 5432,
            "ready_cmd": "pg_isready",
            "ready_timeout_secs": 60,
        },
    ),
    ("import_image", ("oci-archive:/tmp/a b.tar:1",), {"token": "tok"}),
    ("list_images", (), {}),
    ("image_info", ("oci-0123456789ab",), {}),
    ("delete_image", ("oci-0123456789ab",), {}),
    ("delete_snapshot", ("py",), {"cascade": True}),
    ("spawn_sandboxes", ("py",), {"n": 3, "metadata": {"a": "b"}, "idle_timeout_s": 5}),
    ("list_sandboxes", (), {"state": "running", "metadata": {"run": "1"}}),
    ("exec_command", ("sb-1", ["ls", "/"]), {"timeout_secs": 5, "stdin": b"x"}),
    ("exec_command", ("sb-1", ["id"]), {"user": "postgres"}),
    ("eval_code", ("sb-1", "1 + 1"), {"timeout_s": 3}),
    ("branch_sandbox", ("sb-1",), {"tag": "b", "mode": "live", "wait": False}),
    ("set_sandbox_timeout", ("sb-1", 60), {"idle_timeout_s": None}),
    ("write_file", ("sb-1", "/tmp/a b", "héllo"), {}),
    ("read_file", ("sb-1", "/tmp/x"), {}),
    ("remove_file", ("sb-1", "/tmp/x"), {"recursive": True}),
    ("start_process", ("sb-1", "sleep 1"), {"stdin": True, "timeout_s": 9}),
    ("start_process", ("sb-1", ["id"]), {"user": "1000:1000"}),
    ("send_stdin", ("sb-1", 7, b"\x00\xff"), {"eof": True}),
    ("signal_process", ("sb-1", 7, "SIGINT"), {}),
    ("kill_sandbox", ("sb/odd id",), {}),
]


def _answer(request: httpx.Request) -> httpx.Response:
    body: Any = {"written": 2} if request.url.path.endswith("/stdin") else {"ok": True}
    return httpx.Response(200, json=body)


@pytest.mark.parametrize(
    ("method", "args", "kwargs"), CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)]
)
def test_both_clients_send_the_same_request(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return _answer(request)

    with Controller("http://127.0.0.1:1", token="t", transport=httpx.MockTransport(record)) as c:
        sync_result = getattr(c, method)(*args, **kwargs)

    async def run_async() -> Any:
        transport = httpx.MockTransport(record)
        async with AsyncController("http://127.0.0.1:1", token="t", transport=transport) as ac:
            return await getattr(ac, method)(*args, **kwargs)

    async_result = asyncio.run(run_async())
    sync_req, async_req = seen
    assert (sync_req.method, str(sync_req.url)) == (async_req.method, str(async_req.url))
    assert sync_req.content == async_req.content
    assert sync_req.headers.get("authorization") == async_req.headers.get("authorization")
    assert sync_result == async_result
    if sync_req.content and sync_req.headers.get("content-type") == "application/json":
        json.loads(sync_req.content)  # a JSON body is JSON on both
