"""The guest agent's wire format (forkd.agent_wire): the one table of ops both sides use,
the daemon's check of every answer, and the real agent's answers passing it."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd import agent_wire as wire
from forkd import agent_wire_entries as wire_entries
from forkd import wire_shape
from forkd.errors import AgentError
from forkd.vmm.agent.answers import MALFORMED
from forkd.vmm.agent.client import AgentClient
from forkd.vmm.agent.ops import Guest

FILES = Path(__file__).resolve().parents[2] / "src" / "forkd" / "guest" / "files"
AGENT = FILES / "forkd-agent.py"


def test_the_agent_serves_every_op_of_the_wire_and_no_other() -> None:
    if str(FILES) not in sys.path:
        sys.path.insert(0, str(FILES))
    protocol = importlib.import_module("forkd_agent_protocol")
    assert set(protocol.OPS) == set(wire.OPS) | set(wire_entries.OPS)


# ----------------------------------------------------------------------------- check

EXEC_ANSWER = {"exit_code": 0, "stdout": "hi\n", "stderr": "", "timed_out": False}
PROC_READ_ANSWER = {
    "chunks": [],
    "next_offset": 0,
    "gap": None,
    "running": True,
    "exit_code": None,
    "eof": False,
}


def test_an_answer_of_its_ops_shape_is_taken_as_it_is() -> None:
    answer = {**EXEC_ANSWER, "duration_ms": 3, "from_a_newer_agent": [1]}
    wire_shape.check(wire.EXEC.answer, answer)  # an int is a number; extra keys stay


@pytest.mark.parametrize(
    ("op", "answer", "problem"),
    [
        (wire.EXEC, {"stdout": "", "stderr": ""}, "the answer has no 'exit_code'"),
        (wire.EXEC, {**EXEC_ANSWER, "stdout": 5}, "the answer's 'stdout' is not a string"),
        (wire.EXEC, {**EXEC_ANSWER, "exit_code": True}, "is not an integer or null"),
        (wire.EXEC, {**EXEC_ANSWER, "timed_out": 1}, "'timed_out' is not true or false"),
        (wire.EXEC, [], "the answer is not an object"),
        (wire.FILE_LIST, {"entries": {}}, "'entries' is not a list"),
        (
            wire.FILE_LIST,
            {"entries": [{"name": "a", "type": "file", "size": 1, "mode": 420}]},
            "the answer's 'entries'[0] has no 'mtime'",
        ),
        (
            wire.STATS,
            {"mounts": {"/data": {"total_bytes": 1, "used_bytes": "1"}}},
            "'mounts'['/data'] is not Space or null",
        ),
        (wire.PROC_READ, {**PROC_READ_ANSWER, "gap": {"from": 1}}, "'gap' is not OutputGap"),
        (wire.READ_RANGE, {"eof": True, "raw": "not bytes"}, "'raw' is not bytes"),
    ],
)
def test_a_malformed_answer_is_refused_saying_what_and_where(
    op: wire.Op[Any, Any], answer: Any, problem: str
) -> None:
    with pytest.raises(wire_shape.Malformed, match=problem.replace("[", r"\[").replace("]", r"\]")):
        wire_shape.check(op.answer, answer)


def test_fields_an_older_agent_lacks_are_not_required() -> None:
    wire_shape.check(wire.PING.answer, {})
    wire_shape.check(wire.EVAL.answer, {"result": "2"})
    wire_shape.check(wire.READ_RANGE.answer, {"eof": False, "data": "YQ=="})


def test_the_daemon_fails_a_malformed_answer_as_the_agents_error() -> None:
    """Guest checks every answer: a guest answering exec with a number for stdout is an
    AgentError (a 502 from the API), not a value a service goes on with."""

    class Agent:
        async def call(self, op: str, params: Any, **_: Any) -> dict[str, Any]:
            return {"exit_code": 0, "stdout": 5, "stderr": ""}

    ops = Guest("wire-test", Agent())  # type: ignore[arg-type]  # the channel's one method
    with pytest.raises(AgentError, match="answer to exec is malformed") as failed:
        asyncio.run(ops.exec(["true"]))
    assert failed.value.kind == MALFORMED


# ----------------------------------------------------------------------------- a real agent


@pytest.fixture
def ops(tmp_path: Path) -> Iterator[Guest]:
    """The daemon's Guest and AgentClient on a real agent, run on the host."""
    sock = tmp_path / "agent.sock"
    env = {**os.environ, "FORKD_AGENT_DRY_RESTORE": "1"}
    argv = [
        sys.executable,
        str(AGENT),
        "--socket",
        str(sock),
        "--defaults-file",
        str(tmp_path / "defaults.json"),
    ]
    proc = subprocess.Popen(argv, env=env)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.02)
        guest = Guest("wire-test", AgentClient(sock))
        yield guest
    finally:
        proc.terminate()
        proc.wait(10)


def test_every_answer_of_a_real_agent_passes_the_daemons_check(ops: Guest, tmp_path: Path) -> None:
    """Each op the daemon sends, against the real agent: its answer has the op's shape
    (Guest checks each one; a field renamed on one side only fails here and in mypy).
    The fs_* ops need an overlay root and are run in test_agent_fsdiff.py."""
    files = tmp_path / "files"
    files.mkdir()
    target = str(files / "f.txt")

    async def main() -> None:
        await ops.agent.connect(timeout=5)
        try:
            assert (await ops.ping())["pong"] is True
            await ops.configure(env={"A": "1"}, cwd=None, user=None)
            assert (await ops.exec(["sh", "-c", "echo $A"]))["stdout"] == "1\n"
            assert (await ops.eval("1 + 1")).get("result") == "2"
            assert await ops.eval_interrupt() is False
            assert await ops.write_file(target, b"abc") == 3
            assert await ops.read_file(target) == b"abc"
            assert [e["name"] for e in await ops.list_dir(str(files))] == ["f.txt"]
            assert await ops.read_range(target, 1, 10) == (b"bc", 3, True)
            opened = await ops.upload_open(str(files / "g"), b"x")
            assert await ops.upload_write(opened["transfer_id"], 1, b"yz") == 3
            assert await ops.upload_commit(opened["transfer_id"]) == 3
            tar = await ops.tar_open(str(files))
            assert (await ops.tar_read(tar, 1 << 20))[0][:3] != b""
            await ops.transfer_abort(await ops.tar_open_paths([target]))
            await ops.remove(target)
            started = await ops.proc_start(["sh", "-c", "cat; echo done"], stdin=True)
            assert await ops.proc_stdin(started["pid"], b"in\n", eof=True) == 3
            read = await ops.proc_read(started["pid"], 0, wait_s=5, min_bytes=8, linger_s=1)
            assert read["raw"] == b"in\ndone\n"
            assert started["pid"] in [p["pid"] for p in await ops.proc_list()]
            assert (await ops.proc_info(started["pid"]))["cmd"][0] == "sh"
            pty = await ops.proc_start(["sleep", "30"], pty={"cols": 80, "rows": 24})
            await ops.proc_resize(pty["pid"], 100, 30)
            await ops.proc_signal(pty["pid"], "TERM")
            assert set(await ops.stats([str(tmp_path)])) >= {"cpu", "memory", "mounts"}
            restored = await ops.make_unique("wire-test", 10.0)
            assert restored.get("errors")  # a dry run: every step says so
        finally:
            await ops.agent.close()

    asyncio.run(main())
