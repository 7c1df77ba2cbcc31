"""Container images through both Python SDK clients, against the real app under uvicorn
(fake VM driver, fake importer: tests/unit/fake_images.py): import (as JSON and with
its progress streamed), list, info, delete; a template from an image with its service
started and ready, the image's USER the default of every command in its forks; and
each failure a user meets as the ControllerError with the daemon's status."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from forkd.client import AsyncController, AsyncSnapshot, Controller, ControllerError, Snapshot
from tests.unit.conftest import RecordingTransport, Server
from tests.unit.fakes import FakeDriver, FakeVM

WEB = "127.0.0.1:5000/team/web:1"
WEB_ARCHIVE = "oci-archive:/srv/images/web.tar:1"  # the same image, another reference
TOOLS = "docker-daemon:tools:latest"  # another image on the same base layer
UNKNOWN = "127.0.0.1:5000/team/nosuch:1"
SERVICE_PORT = 8080


class ListeningDriver(FakeDriver):
    """Every guest it boots has a TCP socket listening on :data:`SERVICE_PORT`, as
    ``/proc/net/tcp`` says (what the daemon reads to know a service is ready)."""

    async def boot(self, image: Any, **kw: Any) -> FakeVM:
        vm = await super().boot(image, **kw)
        header = "  sl  local_address rem_address   st tx_queue rx_queue\n"
        row = f"   0: 00000000:{SERVICE_PORT:04X} 00000000:0000 0A 00000000:00000000\n"
        vm.contents.files["/proc/net/tcp"] = (header + row).encode()
        return vm


@pytest.fixture
def driver() -> FakeDriver:
    return ListeningDriver()


def _names(images: list[dict[str, Any]]) -> set[str]:
    return {i["name"] for i in images}


def _status(call: Any) -> int:
    with pytest.raises(ControllerError) as exc:
        call()
    return exc.value.status


# ------------------------------------------------------------------ sync client


def test_import_list_info_and_delete(ctl: Controller, server: Server) -> None:
    first = ctl.import_image(WEB)
    assert first["kind"] == "container" and first["name"].startswith("oci-")
    assert first["references"] == [WEB] and first["layers"] == 2
    assert first["bytes_fetched"] > 0 and first["bytes_reused"] == 0
    assert first["config"]["user"] == "app" and first["config"]["exposed_ports"] == ["8080/tcp"]

    again = ctl.import_image(WEB_ARCHIVE)  # the same image: its layers are cached
    assert again["name"] == first["name"]
    assert again["bytes_fetched"] == 0 and again["bytes_reused"] == first["bytes_fetched"]
    assert set(ctl.image_info(first["name"])["references"]) == {WEB, WEB_ARCHIVE}

    tools = ctl.import_image(TOOLS)  # fetches only the layer it does not share
    assert 0 < tools["bytes_fetched"] < tools["bytes_fetched"] + tools["bytes_reused"]
    listed = {i["name"]: i for i in ctl.list_images()}
    assert set(listed) == {"python", first["name"], tools["name"]}
    assert listed["python"]["kind"] == "recipe"
    assert listed[first["name"]]["shared_layer_bytes"] == tools["bytes_reused"]

    assert ctl.delete_image(first["name"]) is None
    assert _status(lambda: ctl.image_info(first["name"])) == 404
    assert _names(ctl.list_images()) == {"python", tools["name"]}
    assert ctl.image_info(tools["name"])["shared_layer_bytes"] == 0  # its base is its own now
    assert server.importer.calls == [WEB, WEB_ARCHIVE, TOOLS]


def test_import_failures_are_the_daemons_statuses(ctl: Controller) -> None:
    assert _status(lambda: ctl.import_image(UNKNOWN)) == 404
    assert _status(lambda: ctl.import_image("")) in (400, 422)  # refused before any import
    assert _status(lambda: ctl.delete_image("oci-000000000000")) == 404
    assert _names(ctl.list_images()) == {"python"}  # nothing left behind
    with pytest.raises(ControllerError) as exc:
        ctl.import_image_progress(UNKNOWN, lambda _msg: None)
    assert exc.value.status == 404 and UNKNOWN in exc.value.message  # the stream's error event


def test_import_with_progress(ctl: Controller) -> None:
    steps: list[str] = []
    info = ctl.import_image_progress(WEB, steps.append)
    assert info["kind"] == "container" and info["bytes_fetched"] > 0
    assert steps[0].startswith("layer 1/2") and steps[-1].startswith("built image")
    steps.clear()
    assert ctl.import_image_progress(WEB, steps.append)["bytes_fetched"] == 0
    assert [s.endswith("cached") for s in steps[:2]] == [True, True]


def test_unreachable_daemon_is_status_0() -> None:
    nowhere = Controller("http://127.0.0.1:9", token="t")
    with nowhere, pytest.raises(ControllerError) as exc:
        nowhere.import_image_progress(WEB, print)
    assert exc.value.status == 0


def test_a_template_from_an_image_starts_its_service(ctl: Controller, server: Server) -> None:
    snap = Snapshot.create(
        "web", controller=ctl, image=WEB, start=True, ready_port=SERVICE_PORT, memory_mib=128
    )
    image = ctl.image_info(snap.info["image"])
    assert image["references"] == [WEB]  # imported on the way
    template = server.driver.vms[0]
    [service] = template.processes.list()  # Entrypoint+Cmd, running when snapshotted
    assert service["cmd"] == ["serve", "8080"] and service["running"]
    assert template.image_defaults == {
        "env": {"PATH": "/bin", "GREETING": "hello from the image"},
        "cwd": "/srv",
        "user": "app",
    }
    [kid] = snap.fork(1)
    with kid:
        assert kid.commands.run(["whoami"]).stdout == "app\n"  # the image's USER
        assert kid.commands.run(["whoami"], user="root").stdout == "root\n"
        assert kid.commands.run(["whoami"], background=True).wait().stdout == "app\n"
    assert ctl.create_snapshot("web-cmd", image=WEB, start=True, ready_cmd="true")["status"] == (
        "ready"
    )


def test_start_failures(ctl: Controller) -> None:
    assert _status(lambda: ctl.create_snapshot("x", image=WEB, ready_port=5432)) == 400
    with pytest.raises(ControllerError) as exc:
        ctl.create_snapshot("x", image=WEB, start=True, ready_port=5432, ready_timeout_secs=1)
    assert exc.value.status == 500 and "port 5432 did not listen" in exc.value.message
    assert "serve" in exc.value.message and "serving on port 8080" in exc.value.message
    assert _status(lambda: ctl.create_snapshot("x", image=UNKNOWN)) == 404
    assert [s["tag"] for s in ctl.list_snapshots()] == []


# ------------------------------------------------------------------ async client


def test_async_images_and_a_template_from_one(server: Server) -> None:
    async def session() -> None:
        async with AsyncController(server.url, token=server.token) as ctl:
            plain: list[str] = []
            info = await ctl.import_image_progress(WEB, plain.append)
            assert info["bytes_fetched"] > 0 and plain[-1].startswith("built image")

            awaited: list[str] = []

            async def report(message: str) -> None:
                await asyncio.sleep(0)
                awaited.append(message)

            again = await ctl.import_image_progress(TOOLS, report)
            assert again["bytes_reused"] > 0 and awaited[-1].startswith("built image")
            assert (await ctl.import_image(WEB))["bytes_fetched"] == 0
            assert _names(await ctl.list_images()) == {"python", info["name"], again["name"]}
            assert (await ctl.image_info(info["name"]))["references"] == [WEB]
            with pytest.raises(ControllerError) as exc:
                await ctl.import_image_progress(UNKNOWN, report)
            assert exc.value.status == 404

            snap = await AsyncSnapshot.create(
                "web", controller=ctl, image=info["name"], start=True, ready_port=SERVICE_PORT
            )
            assert snap.info["image"] == info["name"]
            [kid] = await snap.fork(1)
            async with kid:
                assert (await kid.commands.run(["whoami"])).stdout == "app\n"
                ran = await kid.commands.run(["whoami"], user="1000")
                assert ran.stdout == "1000\n"
                handle = await kid.commands.start(["whoami"], user="postgres")
                assert (await handle.wait()).stdout == "postgres\n"
            await snap.delete()
            await ctl.delete_image(again["name"])  # typed to answer nothing: no error is all
            assert _names(await ctl.list_images()) == {"python", info["name"]}

    asyncio.run(session())


def test_snapshot_create_sends_the_start_fields(server: Server, sent: RecordingTransport) -> None:
    with Controller(server.url, token=server.token, transport=sent) as ctl:
        Snapshot.create("web", controller=ctl, image=WEB, start=True, ready_cmd="test -e /srv")
    assert sent.body(0) == {
        "tag": "web",
        "image": WEB,
        "start": True,
        "ready_cmd": ["/bin/sh", "-c", "test -e /srv"],
    }


STREAM = (
    b": keep-alive\n\n"
    b'event: progress\ndata: {"message": "layer 1/1 sha256:ab: 3 bytes"}\n\n'
    b'event: someday\ndata: {"a kind": "this SDK does not know yet"}\n\n'
    b'event: image\ndata: {"name": "oci-0123456789ab", "kind": "container"}\n\n'
)


def test_both_clients_stream_an_import_alike() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(200, content=STREAM, headers={"Content-Type": "text/event-stream"})

    steps: list[str] = []
    with Controller("http://127.0.0.1:1", token="t", transport=httpx.MockTransport(answer)) as c:
        sync_info = c.import_image_progress("oci:/srv/layout:1", steps.append, token="tok")

    async def run_async() -> dict[str, Any]:
        transport = httpx.MockTransport(answer)
        async with AsyncController("http://127.0.0.1:1", token="t", transport=transport) as ac:
            return await ac.import_image_progress("oci:/srv/layout:1", steps.append, token="tok")

    async_info = asyncio.run(run_async())
    assert sync_info == async_info == {"name": "oci-0123456789ab", "kind": "container"}
    assert steps == ["layer 1/1 sha256:ab: 3 bytes"] * 2
    sync_req, async_req = seen
    assert sync_req.url == async_req.url and sync_req.content == async_req.content
    assert json.loads(sync_req.content) == {"ref": "oci:/srv/layout:1", "token": "tok"}
    assert sync_req.headers["accept"] == async_req.headers["accept"] == "text/event-stream"


@pytest.mark.parametrize(
    ("stream", "status"),
    [
        (b'event: error\ndata: {"error": "unauthorized", "status": 401}\n\n', 401),
        (b'event: progress\ndata: {"message": "layer 1/9"}\n\n', 0),  # ended, unanswered
    ],
)
def test_a_stream_that_ends_without_an_image_is_an_error(stream: bytes, status: int) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=stream, headers={"Content-Type": "text/event-stream"})

    async def run_async() -> None:
        transport = httpx.MockTransport(answer)
        async with AsyncController("http://127.0.0.1:1", token="t", transport=transport) as ac:
            await ac.import_image_progress("oci:/x", print)

    with pytest.raises(ControllerError) as exc:
        asyncio.run(run_async())
    assert exc.value.status == status
    c = Controller("http://127.0.0.1:1", token="t", transport=httpx.MockTransport(answer))
    with c, pytest.raises(ControllerError) as exc:
        c.import_image_progress("oci:/x", print)
    assert exc.value.status == status
