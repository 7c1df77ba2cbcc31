"""Eval over HTTP, the SDK and the CLI: timeout_s, display outputs and the interrupt route.

The real app over the fake VM driver (tests/unit/fakes.py), whose eval runs
in-process and whose display(obj) shows obj's repr. What the guest agent does
with a timeout or an interrupt is tested on a real agent in test_agent_eval.py.
"""

from __future__ import annotations

import asyncio
import base64
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd import limits
from forkd.client import Controller, Sandbox
from forkd.client.results import DisplayOutput, EvalResult
from forkd.errors import AgentError
from forkd.vmm.agent import ops as agent_ops
from tests.unit.conftest import RecordingTransport, Server, env_of, make_app, runner
from tests.unit.fakes import FakeDriver, FakeVM

PNG = b"\x89PNG\r\n\x1a\nfake"


@pytest.fixture
def sandbox_id(client: TestClient) -> str:
    assert client.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).status_code == 201
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "py"})
    assert r.status_code == 201, r.text
    return str(r.json()[0]["id"])


def vm_of(driver: FakeDriver, sandbox_id: str) -> FakeVM:
    return next(vm for vm in driver.vms if vm.id == sandbox_id)


# ------------------------------------------------------------------ HTTP


def test_eval_timeout_defaults_to_60_s_and_is_passed_on(
    client: TestClient, driver: FakeDriver, sandbox_id: str
) -> None:
    assert client.post(f"/v1/sandboxes/{sandbox_id}/eval", json={"code": "1"}).status_code == 200
    body = {"code": "1", "timeout_s": 7200}  # past the old fixed 60 s
    assert client.post(f"/v1/sandboxes/{sandbox_id}/eval", json=body).status_code == 200
    assert vm_of(driver, sandbox_id).eval_timeouts == [limits.EVAL_TIMEOUT_SECS, 7200.0]


def test_eval_error_is_its_last_line_and_the_traceback_is_beside_it(
    client: TestClient, sandbox_id: str
) -> None:
    r = client.post(f"/v1/sandboxes/{sandbox_id}/eval", json={"code": "1 / 0"})
    assert r.status_code == 200
    body = r.json()
    assert body["error"] == "ZeroDivisionError: division by zero"  # as the original answered
    assert body["traceback"].startswith("Traceback (most recent call last):")
    assert body["traceback"].rstrip().endswith(body["error"])
    ok = client.post(f"/v1/sandboxes/{sandbox_id}/eval", json={"code": "1"}).json()
    assert ok["error"] is None and ok.get("traceback") is None


def test_eval_takes_the_original_agents_timeout_field(
    client: TestClient, driver: FakeDriver, sandbox_id: str
) -> None:
    url = f"/v1/sandboxes/{sandbox_id}/eval"
    assert client.post(url, json={"code": "1", "timeout": 7}).status_code == 200
    assert vm_of(driver, sandbox_id).eval_timeouts == [7.0]
    r = client.post(url, json={"code": "1", "timeout": 7, "timeout_s": 8})
    assert r.status_code == 400 and "differ" in r.json()["error"]


@pytest.mark.parametrize("bad", [0, -1, limits.MAX_EVAL_TIMEOUT_SECS + 1, "5", True, None])
def test_eval_rejects_a_bad_timeout(
    client: TestClient, driver: FakeDriver, sandbox_id: str, bad: Any
) -> None:
    r = client.post(f"/v1/sandboxes/{sandbox_id}/eval", json={"code": "1", "timeout_s": bad})
    assert r.status_code == 400, r.text
    assert "timeout_s" in r.text
    assert vm_of(driver, sandbox_id).eval_timeouts == []


def test_eval_answers_with_display_outputs(client: TestClient, sandbox_id: str) -> None:
    r = client.post(f"/v1/sandboxes/{sandbox_id}/eval", json={"code": "display(41)\n42"})
    assert r.status_code == 200
    answer = r.json()
    assert answer["display"] == [{"mime": "text/plain", "data": "41"}]
    assert answer["result"] == "42"
    assert answer["display_truncated"] is False and answer["timed_out"] is False


def test_interrupt_route_says_whether_an_eval_was_running(
    client: TestClient, sandbox_id: str
) -> None:
    r = client.post(f"/v1/sandboxes/{sandbox_id}/eval/interrupt")
    assert r.status_code == 200
    assert r.json() == {"interrupted": False}
    assert client.post("/v1/sandboxes/sb-nope-1/eval/interrupt").status_code == 404


def test_interrupt_of_an_agent_older_than_the_op_is_a_conflict(
    client: TestClient, driver: FakeDriver, sandbox_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unknown_op(context: str | None = None) -> bool:
        raise AgentError("unknown op: 'eval_interrupt'", kind="ValueError")

    monkeypatch.setattr(vm_of(driver, sandbox_id), "eval_interrupt", unknown_op)
    r = client.post(f"/v1/sandboxes/{sandbox_id}/eval/interrupt")
    assert r.status_code == 409
    assert "eval_interrupt" in r.json()["error"]


@pytest.mark.parametrize("kind", ["NoImagePython", "ImagePythonUnsupported"])
def test_eval_in_an_image_without_a_usable_python_is_a_conflict(
    client: TestClient,
    driver: FakeDriver,
    sandbox_id: str,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    why = "this sandbox's image has no python3 on its PATH: eval runs Python in the image"

    async def refused(
        code: str, timeout: float = 60.0, tag: str | None = None, context: str | None = None
    ) -> dict[str, Any]:
        raise AgentError(why, kind=kind)

    monkeypatch.setattr(vm_of(driver, sandbox_id), "eval", refused)
    r = client.post(f"/v1/sandboxes/{sandbox_id}/eval", json={"code": "1"})
    assert r.status_code == 409
    assert why in r.json()["error"]
    assert client.get(f"/v1/sandboxes/{sandbox_id}").json()["state"] == "running"


def test_a_warmup_the_image_cannot_run_is_a_conflict_and_leaves_no_snapshot(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(
        self: FakeVM,
        code: str,
        timeout: float = 60.0,
        tag: str | None = None,
        context: str | None = None,
    ) -> dict[str, Any]:
        raise AgentError("this sandbox's image has no python3 on its PATH", kind="NoImagePython")

    monkeypatch.setattr(FakeVM, "eval", refused)
    body = {"tag": "nopy", "memory_mib": 128, "warmup": "import json"}
    r = client.post("/v1/snapshots", json=body)
    assert r.status_code == 409, r.text
    assert "warmup cannot run" in r.json()["error"] and "no python3" in r.json()["error"]
    assert client.get("/v1/snapshots/nopy").status_code == 404


# ------------------------------------------------------------------ the host's wait


class RecordingAgent:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any] | None, float]] = []

    async def call(
        self,
        op: str,
        params: dict[str, Any] | None = None,
        *,
        wait: float = 30.0,
        payload: bytes | None = None,
    ) -> dict[str, Any]:
        self.calls.append((op, params, wait))
        return {"interrupted": True} if op == "eval_interrupt" else {"result": None}


def test_the_host_waits_for_an_eval_its_timeout_plus_the_agents_grace() -> None:
    ops = agent_ops.Guest("sb-eval", RecordingAgent())  # type: ignore[arg-type]
    asyncio.run(ops.eval("x", timeout=3600))
    assert asyncio.run(ops.eval_interrupt()) is True
    (op, params, wait), interrupt = ops.agent.calls  # type: ignore[attr-defined]
    assert (op, params) == ("eval", {"code": "x", "timeout_s": 3600})
    assert wait == 3600 + agent_ops.EVAL_STOP_GRACE_SECS + agent_ops.EXEC_WAIT_MARGIN_SECS
    assert agent_ops.eval_wait_secs(limits.EVAL_TIMEOUT_SECS) > 60  # no fixed 60 s cap left
    assert interrupt[0] == "eval_interrupt" and interrupt[2] < 60


def test_an_eval_answer_may_hold_the_display_cap_beside_its_streams() -> None:
    from forkd.vmm.agent.client import answer_cap

    assert answer_cap("eval") >= limits.AGENT_OUTPUT_LINE_MAX_BYTES + limits.EVAL_DISPLAY_MAX_BYTES


# ------------------------------------------------------------------ SDK


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


def test_sdk_eval_sends_its_timeout_and_reads_display(
    ctl: Controller, sent: RecordingTransport
) -> None:
    ctl.create_snapshot("py", memory_mib=128)
    sb = Sandbox(sandbox_id=ctl.spawn_sandboxes("py")[0]["id"], controller=ctl)
    result = sb.eval("display('hi')\n6 * 7", timeout=90)
    assert sent.body() == {"code": "display('hi')\n6 * 7", "timeout_s": 90}
    assert sent.last.extensions["timeout"]["read"] >= 90
    assert result.result == "42" and result.timed_out is False
    assert result.display == [DisplayOutput("text/plain", "'hi'")]
    sb.eval("1")
    assert sent.body() == {"code": "1"}  # the daemon's default applies
    assert sb.interrupt() is False
    assert sent.last.url.path.endswith("/eval/interrupt")


def test_display_output_content_decodes_images() -> None:
    raw = {
        "result": None,
        "error": None,
        "exit_code": 0,
        "timed_out": True,
        "display": [
            {"mime": "image/png", "data": base64.b64encode(PNG).decode()},
            {"mime": "text/html", "data": "<b>é</b>"},
        ],
    }
    result = EvalResult.from_answer(raw)
    assert result.display[0].content == PNG
    assert result.display[1].content == "<b>é</b>".encode()
    assert result.timed_out is True


# ------------------------------------------------------------------ CLI


def test_cli_eval_timeout_and_display(
    server: Server, sent: RecordingTransport, ctl: Controller
) -> None:
    ctl.create_snapshot("py", memory_mib=128)
    sid = ctl.spawn_sandboxes("py")[0]["id"]
    app = make_app(sent)
    res = runner.invoke(
        app, ["eval", "--timeout", "5", sid, "display('shown')\n1"], env=env_of(server)
    )
    assert res.exit_code == 0, res.output
    assert res.stdout == "'shown'\n1\n"
    assert sent.body(-1) == {"code": "display('shown')\n1", "timeout_s": 5.0}


def test_cli_eval_saves_rich_displays(
    server: Server,
    sent: RecordingTransport,
    ctl: Controller,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ctl.create_snapshot("py", memory_mib=128)
    sid = ctl.spawn_sandboxes("py")[0]["id"]
    png = {"mime": "image/png", "data": base64.b64encode(PNG).decode()}

    def answer_with_a_png(self: Controller, *args: Any) -> dict[str, Any]:
        return {
            "result": None,
            "error": None,
            "exit_code": 0,
            "stdout": "",
            "stderr": "",
            "display": [png],
        }

    monkeypatch.setattr(Controller, "eval_code", answer_with_a_png)
    app = make_app(sent)
    res = runner.invoke(app, ["eval", sid, "plot()"], env=env_of(server))
    assert res.exit_code == 0 and "[image/png, 12 bytes: --display-dir saves it]" in res.stdout
    out_dir = tmp_path / "shown"
    res = runner.invoke(
        app, ["eval", sid, "plot()", "--display-dir", str(out_dir)], env=env_of(server)
    )
    assert res.exit_code == 0, res.output
    assert (out_dir / "display-1.png").read_bytes() == PNG


def test_cli_ctrl_c_interrupts_the_eval_and_prints_its_traceback(
    server: Server, sent: RecordingTransport, ctl: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl.create_snapshot("py", memory_mib=128)
    sid = ctl.spawn_sandboxes("py")[0]["id"]
    interrupted, started = threading.Event(), threading.Event()

    def eval_until_interrupted(self: Controller, *args: Any) -> dict[str, Any]:
        started.set()
        interrupted.wait(10)
        return {
            "result": None,
            "error": "Traceback ...\nKeyboardInterrupt\n",
            "exit_code": 1,
            "stdout": "",
            "stderr": "",
        }

    def interrupt(self: Controller, sandbox_id: str) -> dict[str, Any]:
        interrupted.set()
        return {"interrupted": True}

    monkeypatch.setattr(Controller, "eval_code", eval_until_interrupted)
    monkeypatch.setattr(Controller, "interrupt_eval", interrupt)
    main_thread = threading.main_thread().ident
    assert main_thread is not None  # started

    def press_ctrl_c() -> None:  # once the eval is asked: a loaded host may be slow to get there
        if started.wait(30):
            time.sleep(0.2)
            signal.pthread_kill(main_thread, signal.SIGINT)

    ctrl_c = threading.Thread(target=press_ctrl_c)
    ctrl_c.start()
    res = runner.invoke(make_app(sent), ["eval", sid, "busy()"], env=env_of(server))
    ctrl_c.join()
    assert interrupted.is_set(), (res.exit_code, res.output, res.exception)
    assert res.exit_code == 1 and res.stderr.endswith("KeyboardInterrupt\n"), res.output
