"""A route method is a method like any other: callable from the class, patchable,
autospec-able, with the signature help() shows."""

from __future__ import annotations

import inspect
from unittest import mock

import httpx

from forkd.client import AsyncController, Controller


def test_a_route_read_from_the_class_is_a_function_of_the_client() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"ok": True})

    with Controller("http://daemon.invalid", transport=httpx.MockTransport(answer)) as ctl:
        assert Controller.health(ctl) == {"ok": True}
        assert ctl.health() == {"ok": True}
    assert seen == ["GET /healthz", "GET /healthz"]
    assert Controller.get_sandbox.__name__ == "get_sandbox"


def test_autospec_and_signatures_see_the_real_parameters() -> None:
    fake = mock.create_autospec(Controller, instance=True)
    fake.get_sandbox("sb-1")
    fake.get_sandbox.assert_called_once_with("sb-1")
    assert (
        str(inspect.signature(Controller.get_sandbox)) == "(self, sandbox_id: 'str') -> 'JSONDict'"
    )
    assert "sandbox_id" in inspect.signature(AsyncController.exec_command).parameters


async def _async_health() -> object:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"ok": True})

    async with AsyncController(
        "http://daemon.invalid", transport=httpx.MockTransport(answer)
    ) as ctl:
        pending = ctl.health()
        assert inspect.isawaitable(pending)
        return await pending


def test_the_async_client_s_routes_are_awaited() -> None:
    import asyncio

    assert asyncio.run(_async_health()) == {"ok": True}
