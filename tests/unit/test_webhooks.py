"""Webhooks over the real app (fake VMs): the daemon's events delivered to a real receiver
on loopback, verified with the ``standardwebhooks`` library as a receiver would; retried
with the same message id until delivered; given up after their time, and said so; never
following a redirect; a hanging endpoint delaying only its own; non-public destinations
refused unless the operator listed them; an outbox that outlives the daemon."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook

from forkd.controller.metrics import Metrics
from forkd.controller.secret_box import SecretBox
from forkd.controller.services.events import EventBus
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow
from forkd.controller.webhooks import delivery
from forkd.controller.webhooks.service import WebhookService
from forkd.states import SandboxState
from tests.unit.conftest import TOKEN, Invoke, Server
from tests.unit.webhook_receiver import Receiver, receiving

_ = Metrics  # (the app's, made by the server fixture)


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries within the test's time: 0.1 s apart, an attempt cut at 1 s."""
    monkeypatch.setattr(delivery, "FIRST_RETRY_SECS", 0.1)
    monkeypatch.setattr(delivery, "MAX_RETRY_SECS", 0.2)
    monkeypatch.setattr(delivery, "ATTEMPT_SECS", 1.0)
    monkeypatch.setattr(delivery, "IDLE_SECS", 0.2)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as r:
        yield r


@pytest.fixture
def other() -> Iterator[Receiver]:
    with receiving() as r:
        yield r


@pytest.fixture
def settings(settings: Settings, receiver: Receiver, other: Receiver) -> Settings:
    allow = (f"127.0.0.1:{receiver.port}", f"127.0.0.1:{other.port}")
    return dataclasses.replace(settings, webhook_allow=allow)


def _client(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"})


def _add(c: httpx.Client, url: str, **body: Any) -> dict[str, Any]:
    made = c.post("/v1/webhooks", json={"url": url, **body})
    assert made.status_code == 201, made.text
    return dict(made.json())


def test_events_are_delivered_signed_as_standard_webhooks(
    server: Server, receiver: Receiver
) -> None:
    with _client(server) as c:
        hook = _add(c, receiver.url, events=["sandbox.created", "sandbox.killed"])
        assert hook["secret"].startswith("whsec_") and hook["events"] == [
            "sandbox.created",
            "sandbox.killed",
        ]
        assert "secret" not in c.get(f"/v1/webhooks/{hook['id']}").json()  # shown once
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        made = {"snapshot_tag": "py", "metadata": {"team": "a"}}
        [sb] = c.post("/v1/sandboxes", json=made).json()
        receiver.until(lambda got: len(got) >= 1)
        c.delete(f"/v1/sandboxes/{sb['id']}").raise_for_status()
        receiver.until(lambda got: len(got) >= 2)
        verifier = Webhook(hook["secret"])
        bodies = [verifier.verify(r.body, r.headers) for r in receiver.got]
        assert [b["type"] for b in bodies] == ["sandbox.created", "sandbox.killed"]
        created, killed = bodies[0]["data"], bodies[1]["data"]
        assert created["sandbox_id"] == sb["id"] and created["sandbox"]["snapshot_tag"] == "py"
        assert (killed["reason"], killed["snapshot_tag"]) == ("user", "py")  # DELETE: yours
        assert killed["metadata"] == {"team": "a"}  # its labels, though its record is gone
        assert len({r.headers["webhook-id"] for r in receiver.got}) == 2
        with pytest.raises(Exception, match="signature"):
            Webhook("whsec_" + "A" * 32).verify(receiver.got[0].body, receiver.got[0].headers)
        done = c.get(f"/v1/webhooks/{hook['id']}/deliveries").json()
        assert [d["status"] for d in done] == ["delivered", "delivered"]
        assert all(d["last_status"] == 204 and d["attempts"] == 1 for d in done)
        assert c.get(f"/v1/webhooks/{hook['id']}").json()["pending"] == 0


def test_a_sandboxs_message_names_its_lineage(server: Server, receiver: Receiver) -> None:
    with _client(server) as c:
        _add(c, receiver.url, events=["sandbox.created"])
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        [child] = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()
        c.post(f"/v1/sandboxes/{child['id']}/branch", json={"tag": "b1"}).raise_for_status()
        [grandchild] = c.post("/v1/sandboxes", json={"snapshot_tag": "b1"}).json()
        receiver.until(lambda got: len(got) == 2)
        said = [json.loads(r.body)["data"]["sandbox"] for r in receiver.got]
        assert [(s["id"], s["lineage"]) for s in said] == [
            (child["id"], ["py"]),
            (grandchild["id"], ["py", "b1"]),
        ]


def test_a_failing_endpoint_gets_the_same_message_again_until_it_takes_it(
    server: Server, receiver: Receiver
) -> None:
    receiver.fail_first = 2
    with _client(server) as c:
        hook = _add(c, receiver.url)
        sent = c.post(f"/v1/webhooks/{hook['id']}/test").json()
        receiver.until(lambda got: len(got) >= 3)
        assert {r.headers["webhook-id"] for r in receiver.got} == {sent["msg_id"]}
        Webhook(hook["secret"]).verify(receiver.got[-1].body, receiver.got[-1].headers)
        time.sleep(0.3)
        [done] = c.get(f"/v1/webhooks/{hook['id']}/deliveries").json()
        assert (done["status"], done["attempts"], done["last_status"]) == ("delivered", 3, 204)


def test_a_dead_endpoint_is_given_up_after_its_time_and_that_is_an_event(
    server: Server, receiver: Receiver, other: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delivery, "RETRY_FOR_SECS", 0.5)
    receiver.status = 503
    with _client(server) as c:
        dead = _add(c, receiver.url, events=["sandbox.created"])
        watcher = _add(c, other.url, events=["webhook.failed"])
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).raise_for_status()
        other.until(lambda got: len(got) >= 1)
        failed = Webhook(watcher["secret"]).verify(other.got[0].body, other.got[0].headers)
        assert failed["type"] == "webhook.failed"
        assert failed["data"]["webhook_id"] == dead["id"] and "503" in failed["data"]["error"]
        [given_up] = c.get(f"/v1/webhooks/{dead['id']}/deliveries").json()
        assert given_up["status"] == "failed" and given_up["attempts"] >= 2
        assert len(receiver.got) == given_up["attempts"]  # not one more after it failed


def test_a_redirect_is_not_followed(server: Server, receiver: Receiver, other: Receiver) -> None:
    receiver.redirect_to = other.url
    with _client(server) as c:
        hook = _add(c, receiver.url)
        c.post(f"/v1/webhooks/{hook['id']}/test")
        receiver.until(lambda got: len(got) >= 2)  # tried again: a 302 is no delivery
        assert other.got == []
        [pending] = c.get(f"/v1/webhooks/{hook['id']}/deliveries").json()
        assert pending["status"] == "pending" and pending["last_status"] == 302


def test_a_hanging_endpoint_delays_only_its_own_deliveries(
    server: Server, receiver: Receiver, other: Receiver
) -> None:
    receiver.hang_secs = 3.0  # past the attempt's 1 s
    with _client(server) as c:
        slow = _add(c, receiver.url)
        fast = _add(c, other.url)
        c.post(f"/v1/webhooks/{slow['id']}/test")
        receiver.until(lambda got: len(got) >= 1)
        started = time.monotonic()
        c.post(f"/v1/webhooks/{fast['id']}/test")
        other.until(lambda got: len(got) >= 1, secs=2.0)
        assert time.monotonic() - started < 1.5
        time.sleep(1.2)
        [hung] = c.get(f"/v1/webhooks/{slow['id']}/deliveries").json()
        assert hung["status"] == "pending" and "no answer within" in (hung["last_error"] or "")


def test_endpoints_the_operator_did_not_allow_are_refused(server: Server) -> None:
    with _client(server) as c:
        for url, why in (
            ("http://127.0.0.2:9/hooks", "--webhook-allow 127.0.0.2:9"),
            ("http://10.1.2.3/hooks", "not a public address"),
            ("http://[::1]:9/", "not a public address"),
            ("http://169.254.169.254/latest", "not a public address"),
            ("ftp://example.test/x", "http:// or https://"),
            ("http://user:pw@127.0.0.1:9/", "no credentials"),
        ):
            refused = c.post("/v1/webhooks", json={"url": url})
            assert refused.status_code == 400 and why in refused.json()["error"], (
                url,
                refused.text,
            )
        for body, why in (
            ({"events": ["sandbox.exploded"]}, "unknown webhook event"),
            ({"secret": "whsec_c2hvcnQ="}, "24-64 bytes"),
            ({"secret": "not base64 !"}, "base64"),
        ):
            refused = c.post("/v1/webhooks", json={"url": "http://127.0.0.2:9/", **body})
            assert refused.status_code == 400 and why in refused.json()["error"], refused.text
        assert c.get("/v1/webhooks").json() == []
        assert c.get("/v1/webhooks/wh_0000000000000000").status_code == 404
        assert c.delete("/v1/webhooks/wh_0000000000000000").status_code == 404


def test_the_outbox_outlives_the_daemon(tmp_path: Path, receiver: Receiver) -> None:
    """An event published is in the store before anything is sent: a daemon that stops
    (or dies) before sending finds it at its next start and delivers it."""
    allow = (f"127.0.0.1:{receiver.port}",)
    store = Store(tmp_path / "forkd.db")
    first = WebhookService(store, SecretBox(tmp_path), EventBus(), allow)

    async def add() -> str:
        _row, secret = await first.add(receiver.url, ["sandbox.created"], None, "")
        return secret or ""

    secret = asyncio.run(add())
    first.events.publish("created", sandbox_id="sb-1")  # its deliverer never started
    store.close()
    assert receiver.got == []

    store = Store(tmp_path / "forkd.db")
    again = WebhookService(store, SecretBox(tmp_path), EventBus(), allow)

    async def deliver() -> None:
        again.deliverer.start()
        while not receiver.got:
            await asyncio.sleep(0.05)
        await again.deliverer.stop()

    asyncio.run(asyncio.wait_for(deliver(), 10))
    body = Webhook(secret).verify(receiver.got[0].body, receiver.got[0].headers)
    assert body["type"] == "sandbox.created" and body["data"]["sandbox_id"] == "sb-1"
    assert json.loads(receiver.got[0].body) == body
    store.close()


def test_an_event_is_in_the_outbox_exactly_when_its_state_change_is(
    tmp_path: Path, receiver: Receiver
) -> None:
    """The outbox row of an event published in a store transaction commits with it: a
    transaction that fails after both took neither (as a crash before its commit would),
    one that commits has both."""
    store = Store(tmp_path / "forkd.db")
    events = EventBus()
    events.guard(store.lock)
    hooks = WebhookService(store, SecretBox(tmp_path), events, (f"127.0.0.1:{receiver.port}",))
    asyncio.run(hooks.add(receiver.url, ["sandbox.paused"], None, ""))
    store.add_sandbox(_running_row("sb-1"))

    def outbox() -> int:
        return len(store.query("SELECT * FROM webhook_deliveries"))

    def state() -> SandboxState:
        row = store.get_sandbox("sb-1")
        assert row is not None
        return row.state

    with pytest.raises(RuntimeError), store.transaction():
        store.set_sandbox_state("sb-1", SandboxState.PAUSED)
        events.publish("paused", sandbox_id="sb-1")
        assert outbox() == 1  # written, in the transaction
        raise RuntimeError("the daemon dies before the commit")
    assert (state(), outbox()) == (SandboxState.RUNNING, 0)

    with store.transaction():
        store.set_sandbox_state("sb-1", SandboxState.PAUSED)
        events.publish("paused", sandbox_id="sb-1")
    assert (state(), outbox()) == (SandboxState.PAUSED, 1)
    store.close()


def test_a_nested_transaction_that_fails_undoes_only_its_own_writes(tmp_path: Path) -> None:
    store = Store(tmp_path / "forkd.db")
    with store.transaction():
        store.add_sandbox(_running_row("sb-1"))
        with pytest.raises(RuntimeError), store.transaction():
            store.add_sandbox(_running_row("sb-2"))
            raise RuntimeError("inner")
    assert [row.id for row in store.list_sandboxes()] == ["sb-1"]
    store.close()


def _running_row(sandbox_id: str) -> SandboxRow:
    return SandboxRow(
        id=sandbox_id,
        snapshot_tag="py",
        run_dir="/nonexistent",
        pid=None,
        created_at_unix=1,
        memory_limit_mib=None,
        expires_at_unix=None,
        state=SandboxState.RUNNING,
    )


def test_the_cli_adds_lists_tests_and_removes_a_webhook(
    forkd: Invoke, receiver: Receiver, tmp_path: Path
) -> None:
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    (tmp_path / "whsec.txt").write_text(secret + "\n")
    added = forkd(
        "webhook", "add", receiver.url, "--event", "sandbox.killed",
        "--secret-file", str(tmp_path / "whsec.txt"), "--json",
    )  # fmt: skip
    assert added.exit_code == 0, added.output
    hook = json.loads(added.output)
    assert hook["events"] == ["sandbox.killed"] and "secret" not in hook  # it was given
    listed = forkd("webhook", "ls")
    assert listed.exit_code == 0 and hook["id"] in listed.output
    sent = forkd("webhook", "test", hook["id"])
    assert sent.exit_code == 0 and "sent msg_test_" in sent.output
    receiver.until(lambda got: len(got) >= 1)
    Webhook(secret).verify(receiver.got[0].body, receiver.got[0].headers)
    time.sleep(0.3)
    shown = forkd("webhook", "deliveries", hook["id"])
    assert shown.exit_code == 0 and "webhook.test" in shown.output and "delivered" in shown.output
    assert forkd("webhook", "rm", hook["id"]).exit_code == 0
    assert hook["id"] not in forkd("webhook", "ls").output
    refused = forkd("webhook", "add", "http://10.9.9.9/x")
    assert refused.exit_code != 0 and "not a public address" in refused.output


def test_a_timeout_kill_says_so(server: Server, receiver: Receiver) -> None:
    with _client(server) as c:
        hook = _add(c, receiver.url, events=["sandbox.expired", "sandbox.killed"])
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        c.post("/v1/sandboxes", json={"snapshot_tag": "py", "timeout_s": 0.3}).raise_for_status()
        receiver.until(lambda got: len(got) >= 2)
    verifier = Webhook(hook["secret"])
    expired, killed = (verifier.verify(r.body, r.headers) for r in receiver.got[:2])
    assert (expired["type"], expired["data"]["reason"]) == ("sandbox.expired", "timeout")
    assert (killed["type"], killed["data"]["reason"]) == ("sandbox.killed", "timeout")


def test_addresses_that_carry_a_private_one_are_not_public() -> None:
    from ipaddress import ip_address

    from forkd.controller.webhooks.destination import _public

    for inside in (
        "::ffff:127.0.0.1",  # mapped
        "::127.0.0.1",  # the old compatible form
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "2002:a00:1::1",  # 6to4 of 10.0.0.1
        "fec0::1",  # site-local
        "fe80::1",
        "::1",
        "0.0.0.0",
        "169.254.169.254",
        "100.64.0.1",  # shared address space (CGNAT)
    ):
        assert not _public(ip_address(inside)), inside
    assert _public(ip_address("2606:4700::1111")) and _public(ip_address("1.1.1.1"))


def test_an_endpoint_that_trickles_is_cut_off_at_the_attempts_deadline(server: Server) -> None:
    """One byte now and then never makes an attempt last past ATTEMPT_SECS (1 s here)."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.wait(0.3):
                conn.sendall(b"X")

    threading.Thread(target=trickle, daemon=True).start()
    try:
        svc = server.app.state.services
        svc.webhooks.allow = svc.webhooks.deliverer.allow = (f"127.0.0.1:{port}",)
        with _client(server) as c:
            hook = _add(c, f"http://127.0.0.1:{port}/slow")
            started = time.monotonic()
            c.post(f"/v1/webhooks/{hook['id']}/test")
            while time.monotonic() - started < 5:
                [d] = c.get(f"/v1/webhooks/{hook['id']}/deliveries").json()
                if d["attempts"]:
                    break
                time.sleep(0.1)
        assert d["attempts"] == 1 and "no answer within 1 s" in d["last_error"]
        assert time.monotonic() - started < 3
    finally:
        stop.set()
        listener.close()
