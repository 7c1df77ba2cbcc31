"""E2B's code interpreter SDK (``e2b_code_interpreter``, pinned) against forkd's E2B port
with fake VMs: run_code in the sandbox's warm Python (its names kept from one execution
to the next), stdout, the last value, errors with name and value, display outputs,
bash, and contexts. The fake guest's eval runs the code in-process (tests/unit/fakes.py);
a real guest's, with a matplotlib PNG, is tests/integration/test_e2b.py's."""

from __future__ import annotations

import time

import e2b
import httpx
import pytest
from e2b_code_interpreter import Sandbox

from tests.unit.conftest import Server
from tests.unit.e2b_port import forkd_client


def test_code_runs_warm_and_answers_as_e2bs_interpreter(e2b_url: str) -> None:
    sbx = Sandbox.create("base")
    first = sbx.run_code("x = 40\nprint('hello')\nx + 1")
    assert first.text == "41" and first.logs.stdout == ["hello\n"] and first.error is None
    assert first.execution_count == 1
    second = sbx.run_code("x + 2")  # the same interpreter: x is still there
    assert second.text == "42" and second.execution_count == 2
    seen: list[str] = []
    sbx.run_code("print('streamed')", on_stdout=lambda m: seen.append(m.line))
    assert seen == ["streamed\n"]
    failed = sbx.run_code("1 / 0")
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == ("ZeroDivisionError", "division by zero")
    assert "ZeroDivisionError" in failed.error.traceback
    shown = sbx.run_code("display([1, 2])")
    assert [r.text for r in shown.results] == ["[1, 2]"]
    sbx.kill()


def test_bash_runs_in_the_guests_shell_and_contexts_are_bash_ones(e2b_url: str) -> None:
    sbx = Sandbox.create("base")
    ran = sbx.run_code("echo from bash", language="bash")
    assert ran.error is None and ran.logs.stdout  # the fake's exec echoes its argv
    ctx = sbx.create_code_context(language="bash", cwd="/tmp")
    assert (ctx.language, ctx.cwd) == ("bash", "/tmp")
    listed = {c.id: c.language for c in sbx.list_code_contexts()}
    assert listed == {"default": "python", ctx.id: "bash"}
    assert sbx.run_code("pwd", context=ctx).error is None
    sbx.remove_code_context(ctx)
    assert [c.id for c in sbx.list_code_contexts()] == ["default"]
    with pytest.raises(e2b.SandboxException):
        sbx.run_code("1", language="ruby")
    sbx.kill()


def test_the_interpreter_takes_only_its_sandboxs_tokens(e2b_url: str) -> None:
    sbx = Sandbox.create("base")
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    assert httpx.get(f"{e2b_url}/contexts", headers=headers).status_code == 401
    wrong = httpx.get(f"{e2b_url}/contexts", headers=headers | {"X-Access-Token": "x"})
    assert wrong.status_code == 502 and "was not found" in wrong.text  # as an unknown id
    envd_port = headers | {"E2b-Sandbox-Port": "49983", "X-Access-Token": sbx._envd_access_token}
    assert httpx.get(f"{e2b_url}/contexts", headers=envd_port).status_code == 502
    sbx.kill()


def test_a_bash_execution_whose_client_leaves_is_killed(server: Server, e2b_url: str) -> None:
    sbx = Sandbox.create("base")
    assert sbx.run_code("echo done", language="bash").logs.stdout == ["done\n"]
    with pytest.raises(e2b.TimeoutException):  # the client gives up after 1 s
        sbx.run_code("serve 9100", language="bash", timeout=1)
    with forkd_client(server) as c:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            procs = c.get(f"/v1/sandboxes/{sbx.sandbox_id}/processes").json()
            served = [p for p in procs if p["cmd"][-1] == "serve 9100"]
            if served and not served[0]["running"]:
                break
            time.sleep(0.1)
    assert served and not served[0]["running"] and served[0]["exit_code"] == 128 + 9
    sbx.kill()


def test_python_and_javascript_contexts_are_eval_contexts_of_their_own(
    server: Server, e2b_url: str
) -> None:
    """Each a worker of its own in the guest (the fake runs every language as Python)."""
    sbx = Sandbox.create("base")
    sbx.run_code("x = 'warm'")
    ctx = sbx.create_code_context(language="python", cwd="/srv")
    assert (ctx.language, ctx.cwd) == ("python", "/srv")
    assert sbx.run_code("x = 'mine'\nx", context=ctx).text == "'mine'"
    assert sbx.run_code("x").text == "'warm'"  # the default context is untouched
    guest = server.app.state.services.vms.live(sbx.sandbox_id).guest
    assert set(guest.contexts) == {ctx.id}
    sbx.restart_code_context(ctx)
    failed = sbx.run_code("x", context=ctx)  # a fresh namespace
    assert failed.error is not None and failed.error.name == "NameError"
    js = sbx.run_code("y = 1\ny", language="js")  # a JavaScript context at first use
    assert js.text == "1" and "js-default" in guest.contexts
    sbx.remove_code_context(ctx)
    assert ctx.id not in guest.contexts
    assert {c.language for c in sbx.list_code_contexts()} == {"python", "javascript"}
    with pytest.raises(e2b.SandboxException):
        sbx.restart_code_context("default")  # the warm interpreter stays
    sbx.kill()


def test_an_executions_envs_are_its_own(e2b_url: str) -> None:
    sbx = Sandbox.create("base")
    given = {"FORKD_UNIT_ENV": "for this one"}
    ran = sbx.run_code("import os\nos.environ['FORKD_UNIT_ENV']", envs=given)
    assert ran.error is None and ran.text == "'for this one'"
    after = sbx.run_code("import os\nos.environ.get('FORKD_UNIT_ENV', 'gone')")
    assert after.text == "'gone'"  # put back once the execution ended
    for bad in ({"A=B": "x"}, {"__proto__": "x"}):
        with pytest.raises(e2b.SandboxException, match="not a variable name"):
            sbx.run_code("1", envs=bad)
    lone = httpx.post(  # a lone surrogate, which E2B's SDK cannot even send
        f"{e2b_url}/execute",
        content=b'{"code": "1", "env_vars": {"LONE": "\\ud800"}}',
        headers={
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": "49999",
            "X-Access-Token": sbx._envd_access_token or "",
            "Content-Type": "application/json",
        },
    )
    assert lone.status_code == 400, lone.text
    emoji = sbx.run_code("os.environ['E']", envs={"E": "\U0001f600 \u2028"})
    assert emoji.text == repr("\U0001f600 \u2028")  # one character, as given
    sbx.kill()
