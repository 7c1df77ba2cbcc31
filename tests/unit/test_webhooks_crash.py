"""Webhooks across a daemon killed with SIGKILL: an event published while its endpoint was
down is in the outbox on disk; the restarted daemon delivers it, and the receiver, once it
drops repeats by ``webhook-id``, has it exactly once. The daemon is ``serve()`` in a
process of its own (fake VMs), killed for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from standardwebhooks import Webhook

from forkd.launcher import free_port
from tests.unit.fakes import make_image
from tests.unit.webhook_receiver import receiving

REPO = Path(__file__).resolve().parents[2]
SERVE = """
import sys
from pathlib import Path
from forkd.controller.server import serve
from forkd.controller.settings import Settings
from forkd.controller.webhooks import delivery
from tests.unit.fakes import FakeDriver
delivery.FIRST_RETRY_SECS = delivery.MAX_RETRY_SECS = 0.2  # retries within the test's time
delivery.IDLE_SECS = 0.2
state = Path(sys.argv[1])
settings = Settings(state_dir=state, snapshot_root=state / "snapshots", run_dir=state / "run",
                    pool_size=0, webhook_allow=(sys.argv[3],))
serve(settings, sys.argv[2], driver=FakeDriver(), log_level="warning")
"""


@contextmanager
def _daemon(tmp_path: Path, allow: str) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    state, sock = tmp_path / "state", tmp_path / "d.sock"
    env = {**os.environ, "FORKD_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("FORKD_TOKEN_FILE", None)
    log = (tmp_path / "daemon.log").open("ab")
    argv = [sys.executable, "-c", SERVE, str(state), f"unix:{sock}", allow]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not (sock.exists() and (state / "token").exists()):
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        token = (state / "token").read_text().strip()
        transport = httpx.HTTPTransport(uds=str(sock))
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(transport=transport, base_url="http://forkd", headers=headers) as c:
            while True:
                try:
                    if c.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the daemon did not answer"
                time.sleep(0.05)
            yield proc, c
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        log.close()


def test_an_event_outlives_a_kill_9_and_is_delivered_once(tmp_path: Path) -> None:
    make_image(tmp_path / "cache")
    port = free_port()  # the receiver's, down at first
    allow = f"127.0.0.1:{port}"
    with _daemon(tmp_path, allow) as (proc, c):
        made = c.post(
            "/v1/webhooks",
            json={"url": f"http://{allow}/hooks", "events": ["sandbox.created"]},
        )
        assert made.status_code == 201, made.text
        hook = made.json()
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        [sb] = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()
        deadline = time.monotonic() + 10
        while True:  # tried (refused: nothing listens), and still to be delivered
            [d] = c.get(f"/v1/webhooks/{hook['id']}/deliveries").json()
            if d["attempts"] >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert d["status"] == "pending" and d["attempts"] >= 1, d
        proc.kill()  # SIGKILL: no shutdown of any kind
        proc.wait(10)

    with receiving(on_port=port) as receiver, _daemon(tmp_path, allow) as (_, c):
        receiver.until(lambda got: len(got) >= 1)
        time.sleep(1.0)  # any repeat would have come by now
        unique = {r.headers["webhook-id"]: r for r in receiver.got}
        assert len(unique) == 1
        [got] = unique.values()
        body = Webhook(hook["secret"]).verify(got.body, got.headers)
        assert body["type"] == "sandbox.created" and body["data"]["sandbox_id"] == sb["id"]
        [d] = c.get(f"/v1/webhooks/{hook['id']}/deliveries").json()
        assert d["status"] == "delivered" and d["msg_id"] == got.headers["webhook-id"]
