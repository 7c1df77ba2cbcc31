"""Eval contexts of the guest agent (forkd_eval_contexts.py, forkd-js-worker.js): E2B's
code interpreter contexts, each a worker of its own beside the agent's interpreter. The
agent runs on the host, its workers in the host's python3 and node (Debian's, as an
image's would be)."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_agent import Client, _stop
from tests.unit.test_agent_image_eval import ENTROPY, _start_agent, staged_agent  # noqa: F401

NODE = shutil.which("node")


@pytest.fixture
def agent(tmp_path: Path, staged_agent: Path) -> Iterator[Client]:  # noqa: F811
    proc, path = _start_agent(tmp_path, staged_agent)
    client = Client(path, timeout=60)
    try:
        yield client
    finally:
        client.close()
        _stop(proc)


def _eval(agent: Client, code: str, **params: Any) -> dict[str, Any]:
    return agent.result("eval", code=code, **{"timeout_s": 30, **params})


def test_a_python_context_has_its_own_namespace_and_directory(
    agent: Client, tmp_path: Path
) -> None:
    assert _eval(agent, "x = 'agent'")["error"] is None
    opened = agent.result("eval_context_open", context="c1", language="python", cwd=str(tmp_path))
    assert opened == {"created": True}
    again = agent.result("eval_context_open", context="c1", language="python")
    assert again == {"created": False}
    assert _eval(agent, "x = 'context'\nimport os\nos.getcwd()", context="c1")["result"] == repr(
        str(tmp_path)
    )
    assert _eval(agent, "x", context="c1")["result"] == "'context'"
    assert _eval(agent, "x")["result"] == "'agent'"  # the agent's own is untouched
    failed = _eval(agent, "1/0", context="c1")
    assert failed["error"].rstrip().endswith("ZeroDivisionError: division by zero")
    assert agent.result("eval_context_close", context="c1") == {"closed": True}
    assert agent.result("eval_context_close", context="c1") == {"closed": False}
    gone = agent.call("eval", code="x", timeout_s=5, context="c1")
    assert gone["ok"] is False and gone["kind"] == "NoContext"


def test_context_requests_are_checked(agent: Client) -> None:
    for bad in (
        {"context": "../x", "language": "python"},
        {"context": "default", "language": "python"},
        {"context": "c", "language": "ruby"},
        {"context": "c", "language": "python", "cwd": "relative"},
    ):
        refused = agent.call("eval_context_open", **bad)
        assert refused["ok"] is False and refused["kind"] == "ValueError", (bad, refused)
    for n in range(16):
        agent.result("eval_context_open", context=f"c{n}", language="python")
    full = agent.call("eval_context_open", context="one-more", language="python")
    assert full["ok"] is False and "16" in full["error"]


@pytest.mark.skipif(NODE is None, reason="this host has no node to stand in for an image's")
def test_a_javascript_context_keeps_its_globals_and_answers_as_python_does(
    agent: Client,
) -> None:
    agent.result("eval_context_open", context="js", language="javascript")
    first = _eval(agent, "const base = 40\nlet seen = []\nconsole.log('hi', {a: 1})", context="js")
    assert (first["error"], first["stdout"], first["result"]) == (None, "hi { a: 1 }\n", None)
    assert _eval(agent, "seen.push(base + 2); seen", context="js")["result"] == "[ 42 ]"
    assert _eval(agent, "process.stdout.write('raw\\n'); 7", context="js")["stdout"] == "raw\n"
    awaited = _eval(agent, "await new Promise(r => setTimeout(() => r(5), 50))", context="js")
    assert awaited["error"] is None, awaited
    thrown = _eval(agent, "null.x", context="js")
    assert thrown["error"].splitlines()[-1].startswith("TypeError: Cannot read properties of null")
    assert "at " in thrown["error"]  # the frames, before the summary line
    slow = _eval(agent, "while (true) {}", context="js", timeout_s=1)
    assert slow["timed_out"] is True and slow["error"] is not None
    assert _eval(agent, "base", context="js")["result"] == "40"  # it lives on


@pytest.mark.skipif(NODE is None, reason="this host has no node to stand in for an image's")
def test_a_running_javascript_eval_is_interrupted(agent: Client, tmp_path: Path) -> None:
    agent.result("eval_context_open", context="js", language="javascript")
    assert _eval(agent, "1", context="js")["result"] == "1"  # the worker is up
    answers: list[dict[str, Any]] = []
    runner = threading.Thread(
        target=lambda: answers.append(
            Client(tmp_path / "agent.sock", timeout=60).result(
                "eval", code="while (true) {}", timeout_s=30, context="js"
            )
        )
    )
    runner.start()
    deadline = time.monotonic() + 10
    interrupted = False
    while not interrupted and time.monotonic() < deadline:
        time.sleep(0.2)
        interrupted = agent.result("eval_interrupt", context="js")["interrupted"]
    runner.join(20)
    assert interrupted and answers, answers
    assert answers[0]["error"].splitlines()[-1].startswith("KeyboardInterrupt")
    with contextlib.suppress(Exception):
        assert _eval(agent, "2", context="js")["result"] == "2"


@pytest.mark.skipif(NODE is None, reason="this host has no node to stand in for an image's")
def test_a_restore_reseeds_every_contexts_worker(agent: Client) -> None:
    """Sibling forks must not draw the same numbers: the restore's reseed reaches each
    context's worker (a Node.js one reseeds its Math.random on SIGUSR2, sent unwaited)."""
    agent.result("eval_context_open", context="js", language="javascript")
    agent.result("eval_context_open", context="py", language="python")
    heard = "globalThis.heard = 0; process.on('SIGUSR2', () => { heard += 1 }); 0"
    assert _eval(agent, heard, context="js")["error"] is None
    seeded = _eval(agent, "import random\nrandom.seed(1)\nrandom.random()", context="py")
    assert _eval(agent, "random.seed(1)", context="py")["error"] is None  # then cloned...
    agent.result("restore", time_ns=time.time_ns(), entropy=ENTROPY, hostname="forkd-x")
    deadline = time.monotonic() + 5
    while _eval(agent, "heard", context="js")["result"] != "1" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _eval(agent, "heard", context="js")["result"] == "1"
    assert 0 <= float(_eval(agent, "Math.random()", context="js")["result"]) < 1
    # The Python worker was reseeded: seed(1) is not what its next draw follows.
    assert _eval(agent, "random.random()", context="py")["result"] != seeded["result"]
