"""The guest agent's process protocol (ops ``proc_*``), one set of cases run against
two backends: the fake the service tests use (tests/unit/fake_processes.py, behind
FakeVM) and the real agent (src/forkd/guest/files/forkd-agent.py serving a unix
socket, no VM), reached through the daemon's own Guest and AgentClient.

The real agent is the truth: a case that fails only for ``fake`` means the fake
drifted from it. The fake's scripts (``exit N``, ``count N SECS``, ``hex HEX``,
``flood``) are given to the real agent as small programs on its PATH, so one
command means the same to both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from forkd import agent_wire as wire
from forkd.controller.services.sandbox_vm import ProcessOps
from forkd.errors import AgentError
from forkd.vmm.agent.client import AgentClient
from forkd.vmm.agent.ops import Guest
from forkd.vmm.qemu.argv import MachineConfig
from tests.unit.fakes import FakeVM, GuestContents

AGENT = Path(__file__).resolve().parents[2] / "src" / "forkd" / "guest" / "files" / "forkd-agent.py"
NO_SUCH_PID = 2**30  # above the kernel's pid_max
RING_BYTES = 4 << 20  # what each process's output ring holds, in both
WAIT_S = 10.0  # for a process to exit or its output to end; a case takes far less

# The fake's scripts (see fake_processes.py), as programs the real agent runs.
SCRIPTS = {
    "exit": '#!/bin/sh\necho "exit $1" >&2\nexit "$1"\n',
    "count": '#!/bin/sh\ni=1\nwhile [ "$i" -le "$1" ]; do\n'
    '  echo "$i"; sleep "$2"; i=$((i + 1))\ndone\n',
    "hex": f"#!{sys.executable}\nimport sys\nsys.stdout.buffer.write(bytes.fromhex(sys.argv[1]))\n",
    "flood": f"#!{sys.executable}\nimport sys\n"
    "while True:\n    sys.stdout.buffer.write(b'x' * 65536)\n",
}


@dataclass
class Processes:
    """One backend's processes for one case: started with the scripts' PATH, and
    remembered, to be killed afterwards."""

    ops: ProcessOps
    env: dict[str, str]
    started: list[int] = field(default_factory=list)

    async def start(self, cmd: list[str] | str, **kw: Any) -> wire.ProcInfo:
        info = await self.ops.proc_start(cmd, env=self.env, **kw)
        self.started.append(info["pid"])
        return info

    async def exited(self, pid: int) -> wire.ProcInfo:
        """Its info once it has exited."""
        deadline = time.monotonic() + WAIT_S
        while (info := await self.ops.proc_info(pid))["running"]:
            assert time.monotonic() < deadline, f"process {pid} still runs: {info}"
            await asyncio.sleep(0.01)
        return info

    async def output(self, pid: int, offset: int = 0) -> tuple[list[tuple[str, bytes]], int]:
        """Each chunk's stream and bytes from ``offset`` until the end of the output,
        and the end's offset."""
        chunks: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + WAIT_S
        while True:
            answer = await self.ops.proc_read(pid, offset, wait_s=1.0)
            assert time.monotonic() < deadline, f"no end of process {pid}'s output: {chunks}"
            chunks += _chunks(answer)
            offset = answer["next_offset"]
            if answer["eof"]:
                return chunks, offset

    async def kill_started(self) -> None:
        """Kill what still runs and wait until it has exited: the next case counts on it."""
        for pid in self.started:
            with _no_such_process():
                await self.ops.proc_signal(pid, "KILL")  # nothing once it has exited
        for pid in self.started:
            with _no_such_process():
                await self.exited(pid)


@contextlib.contextmanager
def _no_such_process() -> Iterator[None]:
    """Ignore ProcessLookupError: the agent forgot an exited process."""
    try:
        yield
    except AgentError as exc:
        if exc.kind != "ProcessLookupError":
            raise


def _chunks(answer: wire.ProcReadAnswer) -> list[tuple[str, bytes]]:
    """A raw read's chunks with their bytes, checking that the sizes add up (an
    answer without bytes has no ``raw``)."""
    raw, pos, chunks = answer.get("raw", b""), 0, []
    for chunk in answer["chunks"]:
        chunks.append((chunk["stream"], raw[pos : pos + chunk["size"]]))
        pos += chunk["size"]
    assert pos == len(raw), answer
    return chunks


async def _refusal(call: Awaitable[Any]) -> tuple[str | None, str]:
    """The kind and message of the agent's error answer to ``call``."""
    with pytest.raises(AgentError) as refused:
        await call
    return refused.value.kind, str(refused.value)


# ----------------------------------------------------------------------------- backends


def _write_scripts(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in SCRIPTS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def _start_agent(sock: Path) -> subprocess.Popen[bytes]:
    agent = subprocess.Popen([sys.executable, str(AGENT), "--socket", str(sock)])
    deadline = time.monotonic() + WAIT_S
    while True:  # listening, not only bound
        assert agent.poll() is None and time.monotonic() < deadline, "the agent did not start"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(sock))
            return agent
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.02)
        finally:
            probe.close()


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment every case's processes get: the scripts first on PATH."""
    bin_dir = tmp_path_factory.mktemp("contract") / "bin"
    _write_scripts(bin_dir)
    return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"}


@pytest.fixture(scope="module")
def agent_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    sock = tmp_path_factory.mktemp("agent") / "agent.sock"
    agent = _start_agent(sock)
    yield sock
    agent.terminate()  # each case killed what it started
    agent.wait(WAIT_S)


Case = Callable[[Processes], Awaitable[None]]


@dataclass
class Backend:
    name: str
    open: Callable[[], AbstractAsyncContextManager[ProcessOps]]
    env: dict[str, str]

    def run(self, case: Case) -> None:
        async def main() -> None:
            async with self.open() as ops:
                procs = Processes(ops, self.env)
                try:
                    await case(procs)
                finally:
                    await procs.kill_started()

        asyncio.run(main())


@pytest.fixture(params=["fake", "agent"])
def backend(request: pytest.FixtureRequest, scripts: dict[str, str], tmp_path: Path) -> Backend:
    if request.param == "fake":

        @asynccontextmanager
        async def fake() -> AsyncIterator[ProcessOps]:
            machine = MachineConfig(1, 1, "tcg", Path("/k"), Path("/i"), Path("/r"))
            yield FakeVM("sb-contract", machine, tmp_path, GuestContents())

        return Backend("fake", fake, scripts)
    sock: Path = request.getfixturevalue("agent_socket")

    @asynccontextmanager
    async def real() -> AsyncIterator[ProcessOps]:
        client = AgentClient(sock)
        await client.connect(timeout=WAIT_S)
        ops = Guest("sb-contract", client)
        try:
            yield ops
        finally:
            await client.close()

    return Backend("agent", real, scripts)


# ----------------------------------------------------------------------------- start, info, list

INFO_FIELDS = {
    "pid",
    "cmd",
    "pty",
    "stdin",
    "running",
    "exit_code",
    "started_at",
    "ended_at",
    "output_start",
    "output_end",
}
READ_FIELDS = {"chunks", "next_offset", "gap", "running", "exit_code", "eof", "raw"}


def test_a_start_answers_the_info_of_a_running_process(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        before = time.time()
        info = await procs.start(["sleep", "30"])
        assert set(info) == INFO_FIELDS
        assert type(info["pid"]) is int and before - 1 <= info["started_at"] <= time.time()
        assert {k: v for k, v in info.items() if k not in ("pid", "started_at")} == {
            "cmd": ["sleep", "30"],
            "pty": False,
            "stdin": False,
            "running": True,
            "exit_code": None,
            "ended_at": None,
            "output_start": 0,
            "output_end": 0,
        }
        assert await procs.ops.proc_info(info["pid"]) == info

    backend.run(case)


def test_a_string_command_runs_under_sh(backend: Backend) -> None:
    if backend.name == "agent" and os.getuid() != 0:
        pytest.skip("the agent runs commands as itself: root in a guest, not here")

    async def case(procs: Processes) -> None:
        info = await procs.start("id -un")
        assert info["cmd"] == ["/bin/sh", "-c", "id -un"]
        assert await procs.output(info["pid"]) == ([("stdout", b"root\n")], 5)
        assert (await procs.exited(info["pid"]))["exit_code"] == 0

    backend.run(case)


def test_the_list_holds_each_process_as_its_info_in_start_order(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        sleeper = await procs.start(["sleep", "30"])
        echo = await procs.start(["echo", "a", "b"])
        ended = await procs.exited(echo["pid"])
        listed = [p for p in await procs.ops.proc_list() if p["pid"] in procs.started]
        assert [p["pid"] for p in listed] == [sleeper["pid"], echo["pid"]]
        assert listed[0] == sleeper and listed[1] == ended
        assert ended["ended_at"] is not None and ended["ended_at"] >= ended["started_at"]
        assert ended["output_end"] == 4

    backend.run(case)


def test_a_missing_program_is_file_not_found(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        assert await _refusal(procs.start(["nosuch"])) == (
            "FileNotFoundError",
            "[Errno 2] No such file or directory: 'nosuch'",
        )

    backend.run(case)


# ----------------------------------------------------------------------------- output


def test_output_after_the_exit_is_kept_and_read_to_its_eof(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["echo", "a", "b"]))["pid"]
        await procs.output(pid)
        answer = await procs.ops.proc_read(pid, 0)
        assert answer == {
            "chunks": [{"stream": "stdout", "offset": 0, "size": 4}],
            "next_offset": 4,
            "gap": None,
            "running": False,
            "exit_code": 0,
            "eof": True,
            "raw": b"a b\n",
        }
        assert await procs.ops.proc_read(pid, 4, wait_s=1.0) == {
            "chunks": [],
            "next_offset": 4,
            "gap": None,
            "running": False,
            "exit_code": 0,
            "eof": True,
        }

    backend.run(case)


def test_stderr_is_tagged_and_the_exit_code_is_the_programs(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["exit", "3"]))["pid"]
        assert await procs.output(pid) == ([("stderr", b"exit 3\n")], 7)
        info = await procs.exited(pid)
        assert (info["exit_code"], info["output_end"]) == (3, 7)

    backend.run(case)


def test_a_run_of_one_stream_is_one_chunk_cut_at_offset_and_max_bytes(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["count", "3", "0.01"]))["pid"]
        assert b"".join(data for _, data in (await procs.output(pid))[0]) == b"1\n2\n3\n"
        answer = await procs.ops.proc_read(pid, 1, max_bytes=3)
        assert answer == {
            "chunks": [{"stream": "stdout", "offset": 1, "size": 3}],
            "next_offset": 4,
            "gap": None,
            "running": False,
            "exit_code": 0,
            "eof": False,
            "raw": b"\n2\n",
        }

    backend.run(case)


def test_binary_output_comes_as_it_was_written(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["hex", "00ff0a80"]))["pid"]
        assert await procs.output(pid) == ([("stdout", b"\x00\xff\n\x80")], 4)

    backend.run(case)


def test_the_ring_drops_the_oldest_output_and_a_read_before_it_gets_the_gap(
    backend: Backend,
) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["flood"]))["pid"]
        deadline = time.monotonic() + WAIT_S
        while (info := await procs.ops.proc_info(pid))["output_start"] == 0:
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.01)
        assert 0 < info["output_end"] - info["output_start"] <= RING_BYTES
        answer = await procs.ops.proc_read(pid, 0, max_bytes=10)
        gap = answer["gap"]
        assert gap is not None
        start = gap["to"]
        assert gap == {"from": 0, "to": start} and start >= info["output_start"]
        assert answer["chunks"] == [{"stream": "stdout", "offset": start, "size": 10}]
        assert (answer["raw"], answer["next_offset"], answer["eof"]) == (
            b"x" * 10,
            start + 10,
            False,
        )
        await procs.ops.proc_signal(pid, "KILL")
        assert (await procs.exited(pid))["exit_code"] == 137

    backend.run(case)


def test_a_read_past_the_end_or_before_zero_is_refused(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["echo", "a", "b"]))["pid"]
        await procs.output(pid)
        read = procs.ops.proc_read
        assert await _refusal(read(pid, 99)) == (
            "ValueError",
            "offset 99 is past the end of the output (4)",
        )
        assert await _refusal(read(pid, -1)) == ("ValueError", "'offset' must be an integer >= 0")
        assert await _refusal(read(pid, 0, max_bytes=0)) == (
            "ValueError",
            "'max_bytes' must be an integer from 1 to 1048576",
        )
        assert await _refusal(read(pid, 0, wait_s=31)) == (
            "ValueError",
            "'wait_s' must be a number of seconds from 0 to 30",
        )

    backend.run(case)


# ----------------------------------------------------------------------------- stdin


def test_a_read_waits_for_output_and_stdin_then_eof_ends_cat(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        info = await procs.start(["cat"], stdin=True)
        pid = info["pid"]
        assert info["stdin"] is True
        assert await procs.ops.proc_read(pid, 0) == {
            "chunks": [],
            "next_offset": 0,
            "gap": None,
            "running": True,
            "exit_code": None,
            "eof": False,
        }
        assert await procs.ops.proc_stdin(pid, b"hello\n") == 6
        answer = await procs.ops.proc_read(pid, 0, wait_s=WAIT_S)
        assert set(answer) == READ_FIELDS and _chunks(answer) == [("stdout", b"hello\n")]
        assert (answer["next_offset"], answer["eof"]) == (6, False)
        assert await procs.ops.proc_stdin(pid, b"bye\n", eof=True) == 4
        assert await procs.output(pid, 6) == ([("stdout", b"bye\n")], 10)
        assert (await procs.exited(pid))["exit_code"] == 0

    backend.run(case)


def test_stdin_after_eof_or_after_the_exit_is_a_broken_pipe(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["sleep", "30"], stdin=True))["pid"]  # never reads it
        assert await procs.ops.proc_stdin(pid, b"", eof=True) == 0
        assert await _refusal(procs.ops.proc_stdin(pid, b"more")) == (
            "BrokenPipeError",
            f"[Errno 32] process {pid} has its stdin closed",
        )
        await procs.ops.proc_signal(pid, "KILL")
        await procs.exited(pid)
        assert await _refusal(procs.ops.proc_stdin(pid, b"more")) == (
            "BrokenPipeError",
            f"[Errno 32] process {pid} has exited",
        )

    backend.run(case)


def test_stdin_of_a_process_started_without_it_is_a_value_error(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["sleep", "30"]))["pid"]
        assert await _refusal(procs.ops.proc_stdin(pid, b"x")) == (
            "ValueError",
            f"process {pid} was started without stdin",
        )

    backend.run(case)


# ----------------------------------------------------------------------------- signals, timeout


@pytest.mark.parametrize(
    ("sent", "exit_code"),
    [("TERM", 143), ("SIGTERM", 143), ("term", 143), (15, 143), ("KILL", 137)],
)
def test_a_signal_by_name_or_number_ends_the_process_with_128_plus_it(
    backend: Backend, sent: str | int, exit_code: int
) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["sleep", "30"]))["pid"]
        await procs.ops.proc_signal(pid, sent)
        info = await procs.exited(pid)
        assert (info["exit_code"], info["running"]) == (exit_code, False)
        await procs.ops.proc_signal(pid, "TERM")  # after the exit: nothing, no error
        assert (await procs.ops.proc_info(pid))["exit_code"] == exit_code

    backend.run(case)


def test_a_signal_the_process_ignores_leaves_it_running(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["sleep", "30"]))["pid"]
        await procs.ops.proc_signal(pid, "WINCH")
        await asyncio.sleep(0.1)  # long enough for a real process to die of it
        assert (await procs.ops.proc_info(pid))["running"] is True

    backend.run(case)


def test_a_bad_signal_is_refused_before_the_pid_is_looked_up(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        signal = procs.ops.proc_signal
        assert await _refusal(signal(NO_SUCH_PID, "NOPE")) == (
            "ValueError",
            "unknown signal: 'NOPE'",
        )
        assert await _refusal(signal(NO_SUCH_PID, 999)) == (
            "ValueError",
            '\'signal\' must be a signal number or a name like "SIGTERM" or "TERM"',
        )

    backend.run(case)


def test_a_timeout_kills_the_process_with_exit_code_124(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["sleep", "30"], timeout_s=0.2))["pid"]
        info = await procs.exited(pid)
        assert info["exit_code"] == 124 and info["ended_at"] is not None
        assert info["ended_at"] - info["started_at"] > 0.1

    backend.run(case)


# ----------------------------------------------------------------------------- pty


def test_a_pty_process_has_stdin_one_pty_stream_and_a_size_to_change(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        info = await procs.start(["hex", "6869"], pty={"cols": 80, "rows": 24})
        assert (info["pty"], info["stdin"]) == (True, True)
        # No newline: a real terminal would write "\r\n" for it (the fake has no line discipline).
        assert await procs.output(info["pid"]) == ([("pty", b"hi")], 2)
        cat = (await procs.start(["cat"], pty={"cols": 80, "rows": 24}))["pid"]
        await procs.ops.proc_resize(cat, 120, 40)  # typed to answer nothing: no error is all
        assert await procs.ops.proc_stdin(cat, b"", eof=True) == 0  # ^D at a line's start
        assert await procs.output(cat) == ([], 0)
        assert (await procs.exited(cat))["exit_code"] == 0

    backend.run(case)


def test_a_resize_without_a_pty_or_out_of_bounds_is_refused(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        pid = (await procs.start(["sleep", "30"]))["pid"]
        assert await _refusal(procs.ops.proc_resize(pid, 80, 24)) == (
            "ValueError",
            f"process {pid} has no pty",
        )
        assert await _refusal(procs.ops.proc_resize(pid, 0, 24)) == (
            "ValueError",
            "'cols' must be an integer from 1 to 1000",
        )

    backend.run(case)


# ----------------------------------------------------------------------------- refusals


def test_every_op_on_an_unknown_pid_is_process_lookup_error(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        ops = procs.ops
        expected = ("ProcessLookupError", f"no background process with pid {NO_SUCH_PID}")
        for call in (
            ops.proc_info(NO_SUCH_PID),
            ops.proc_read(NO_SUCH_PID, 0),
            ops.proc_stdin(NO_SUCH_PID, b"x"),
            ops.proc_signal(NO_SUCH_PID, "TERM"),
            ops.proc_resize(NO_SUCH_PID, 80, 24),
        ):
            assert await _refusal(call) == expected

    backend.run(case)


@pytest.mark.parametrize(
    ("cmd", "params", "message"),
    [
        ([], {}, "'cmd' must be a non-empty string or a non-empty list of strings"),
        ("", {}, "'cmd' must be a non-empty string or a non-empty list of strings"),
        (["echo", "a\0b"], {}, "'cmd' must not contain a NUL byte"),
        (["sleep", "1"], {"timeout_s": 0}, "'timeout_s' must be > 0 and finite"),
    ],
)
def test_a_bad_start_is_a_value_error(
    backend: Backend, cmd: list[str] | str, params: dict[str, Any], message: str
) -> None:
    async def case(procs: Processes) -> None:
        assert await _refusal(procs.start(cmd, **params)) == ("ValueError", message)

    backend.run(case)


def test_at_most_64_processes_run_at_once(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        running = [p for p in await procs.ops.proc_list() if p["running"]]
        assert running == []  # every case killed what it started
        for _ in range(64):
            await procs.start(["sleep", "30"])
        assert await _refusal(procs.start(["sleep", "30"])) == (
            "BlockingIOError",
            "too many background processes running (at most 64)",
        )

    backend.run(case)


def test_only_the_64_most_recent_exited_processes_are_kept(backend: Backend) -> None:
    async def case(procs: Processes) -> None:
        first = (await procs.start(["echo", "first"]))["pid"]
        await procs.exited(first)
        later = [(await procs.start(["echo", str(i)]))["pid"] for i in range(64)]
        for pid in later:
            await procs.exited(pid)
        listed = {p["pid"] for p in await procs.ops.proc_list()}
        assert set(later) <= listed and first not in listed
        assert await _refusal(procs.ops.proc_info(first)) == (
            "ProcessLookupError",
            f"no background process with pid {first}",
        )

    backend.run(case)
