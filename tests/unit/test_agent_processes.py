"""Background processes of the guest agent (ops proc_*), run on the host.

The real agent program (src/forkd/guest/files/forkd-agent.py with its
forkd_procs.py) serves a unix socket as a subprocess; its processes are real
processes of this machine.
"""

from __future__ import annotations

import base64
import importlib.util
import itertools
import json
import socket
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FILES = Path(__file__).resolve().parents[2] / "src" / "forkd" / "guest" / "files"
AGENT = FILES / "forkd-agent.py"
RING_BYTES = 4 * 1024 * 1024  # forkd_procs.RING_BYTES, as the protocol states it
NO_SUCH_PID = 2**30  # above the kernel's pid_max


class AgentConnection:
    """One connection to the agent: send a request, wait for its answer by id."""

    _ids = itertools.count(1)

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(40)
        self._pending = b""

    def close(self) -> None:
        self.sock.close()

    def call(self, op: str, **params: Any) -> dict[str, Any]:
        req_id = next(self._ids)
        self.sock.sendall(json.dumps({"id": req_id, "op": op, **params}).encode() + b"\n")
        while True:
            while b"\n" not in self._pending:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise EOFError("the agent closed the connection")
                self._pending += chunk
            line, self._pending = self._pending.split(b"\n", 1)
            self.last_line_bytes = len(line)
            answer = json.loads(line)
            if "raw" in answer:  # that many bytes follow the line, and belong to it
                while len(self._pending) < answer["raw"]:
                    self._pending += self.sock.recv(1 << 20)
                raw, self._pending = self._pending[: answer["raw"]], self._pending[answer["raw"] :]
                answer["result"]["raw"] = raw
            if answer.get("id") == req_id:  # requests are sequential: no other answers
                return answer

    def ok(self, op: str, **params: Any) -> dict[str, Any]:
        answer = self.call(op, **params)
        assert answer["ok"] is True, answer
        return answer["result"]

    def error_kind(self, op: str, **params: Any) -> str:
        answer = self.call(op, **params)
        assert answer["ok"] is False, answer
        assert answer["error"], answer
        return answer["kind"]

    def start(self, cmd: str | list[str], **params: Any) -> int:
        return self.ok("proc_start", cmd=cmd, **params)["pid"]

    def read_until_eof(self, pid: int, offset: int = 0, limit_s: float = 10.0) -> list[dict]:
        """Every chunk from ``offset`` until eof, data decoded; fails after ``limit_s``."""
        chunks: list[dict] = []
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            result = self.ok("proc_read", pid=pid, offset=offset, wait_s=1.0)
            for chunk in result["chunks"]:
                chunks.append({**chunk, "data": base64.b64decode(chunk["data"])})
            offset = result["next_offset"]
            if result["eof"]:
                return chunks
        raise AssertionError(f"no eof from process {pid} within {limit_s} s: {chunks}")

    def output_until_eof(self, pid: int) -> bytes:
        return b"".join(chunk["data"] for chunk in self.read_until_eof(pid))

    def read_until(self, pid: int, wanted: bytes, offset: int = 0) -> tuple[bytes, int]:
        """Output from ``offset`` until it contains ``wanted``; (output, next offset)."""
        output = b""
        deadline = time.monotonic() + 10
        while wanted not in output:
            assert time.monotonic() < deadline, f"no {wanted!r} in {output!r}"
            result = self.ok("proc_read", pid=pid, offset=offset, wait_s=1.0)
            output += b"".join(base64.b64decode(chunk["data"]) for chunk in result["chunks"])
            offset = result["next_offset"]
        return output, offset


def _start_agent(path: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, str(AGENT), "--socket", str(path)])
    deadline = time.monotonic() + 10
    while True:  # listening, not only bound: the socket file exists between the two
        assert proc.poll() is None and time.monotonic() < deadline, "the agent did not start"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            return proc
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.02)
        finally:
            probe.close()


def _stop_agent(proc: subprocess.Popen[bytes], path: Path) -> None:
    """Kill the processes it still runs (they would outlive it), then the agent."""
    with _connect(path) as conn:
        for info in conn.ok("proc_list")["processes"]:
            if info["running"]:
                conn.ok("proc_signal", pid=info["pid"], signal="SIGKILL")
    proc.terminate()
    proc.wait(10)


class _connect:
    def __init__(self, path: Path) -> None:
        self.conn = AgentConnection(path)

    def __enter__(self) -> AgentConnection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def agent_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("agent") / "agent.sock"
    proc = _start_agent(path)
    yield path
    _stop_agent(proc, path)


@pytest.fixture
def agent(agent_path: Path) -> Iterator[AgentConnection]:
    with _connect(agent_path) as conn:
        yield conn


@pytest.fixture
def fresh_agent(tmp_path: Path) -> Iterator[AgentConnection]:
    """An agent of its own, for tests that count every process it has."""
    path = tmp_path / "agent.sock"
    proc = _start_agent(path)
    try:
        with _connect(path) as conn:
            yield conn
    finally:
        _stop_agent(proc, path)


def _process_gone(pid: int) -> bool:
    """No such process on this machine, or only its zombie (killed, not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# ----------------------------------------------------------------------------- start


def test_start_argv_returns_process_info_and_runs_it(agent: AgentConnection) -> None:
    before = time.time()
    info = agent.ok("proc_start", cmd=["echo", "hello"])
    assert info["cmd"] == ["echo", "hello"]
    assert isinstance(info["pid"], int) and info["pid"] > 0
    assert (info["pty"], info["stdin"]) == (False, False)
    assert before - 1 <= info["started_at"] <= time.time() + 1
    assert info["output_start"] == 0

    assert agent.output_until_eof(info["pid"]) == b"hello\n"
    done = agent.ok("proc_info", pid=info["pid"])
    assert (done["running"], done["exit_code"]) == (False, 0)
    assert done["ended_at"] >= done["started_at"]
    assert (done["output_start"], done["output_end"]) == (0, 6)


def test_start_string_runs_under_sh_with_env_and_cwd(agent: AgentConnection) -> None:
    info = agent.ok(
        "proc_start",
        cmd='echo "$((6 * 7)) $GREETING $(pwd) $PATH"',
        env={"GREETING": "hi"},
        cwd="/",
    )
    assert info["cmd"][:2] == ["/bin/sh", "-c"]
    assert (
        agent.output_until_eof(info["pid"])
        == b"42 hi / /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
    )


def test_start_of_a_missing_program_is_file_not_found(agent: AgentConnection) -> None:
    assert agent.error_kind("proc_start", cmd=["/no/such/program"]) == "FileNotFoundError"
    assert agent.error_kind("proc_start", cmd=["true"], cwd="/no/such/dir") == "FileNotFoundError"


def test_process_outlives_its_request_and_connection(agent_path: Path) -> None:
    with _connect(agent_path) as first:
        started = time.monotonic()
        pid = first.start("sleep 0.5; echo late")
        assert time.monotonic() - started < 0.5  # answered before the process ended
    with _connect(agent_path) as second:
        assert second.ok("proc_info", pid=pid)["cmd"][2] == "sleep 0.5; echo late"
        assert second.output_until_eof(pid) == b"late\n"


# ----------------------------------------------------------------------------- output


def test_read_with_wait_returns_as_soon_as_output_arrives(agent: AgentConnection) -> None:
    pid = agent.start("echo first; sleep 0.6; echo second; sleep 30")
    try:
        first, offset = agent.read_until(pid, b"first\n")
        assert (first, offset) == (b"first\n", 6)

        started = time.monotonic()
        result = agent.ok("proc_read", pid=pid, offset=offset, wait_s=20)
        elapsed = time.monotonic() - started
        assert elapsed < 5, f"waited {elapsed:.1f} s for a line due after 0.6 s"
        assert [base64.b64decode(c["data"]) for c in result["chunks"]] == [b"second\n"]
        assert result["chunks"][0]["offset"] == 6
        assert (result["next_offset"], result["running"], result["eof"]) == (13, True, False)

        started = time.monotonic()
        idle = agent.ok("proc_read", pid=pid, offset=13, wait_s=0.3)
        assert 0.25 <= time.monotonic() - started < 5
        assert (idle["chunks"], idle["next_offset"], idle["eof"]) == ([], 13, False)
    finally:
        agent.ok("proc_signal", pid=pid, signal="SIGKILL")


def test_read_with_min_bytes_lingers_for_more_output_up_to_linger_s(agent: AgentConnection) -> None:
    pid = agent.start("printf a; sleep 0.2; printf b; sleep 30")
    try:
        agent.read_until(pid, b"a")
        started = time.monotonic()
        both = agent.ok("proc_read", pid=pid, offset=0, wait_s=5, min_bytes=2, linger_s=1)
        assert time.monotonic() - started < 0.9  # answered when the second byte came
        assert b"".join(base64.b64decode(c["data"]) for c in both["chunks"]) == b"ab"

        started = time.monotonic()
        short = agent.ok("proc_read", pid=pid, offset=0, wait_s=5, min_bytes=100, linger_s=0.3)
        assert 0.25 <= time.monotonic() - started < 4  # what there is, once linger_s passed
        assert short["next_offset"] == 2
    finally:
        agent.ok("proc_signal", pid=pid, signal="SIGKILL")


def test_lingering_ends_at_the_end_of_the_output(agent: AgentConnection) -> None:
    pid = agent.start("printf abc")
    agent.output_until_eof(pid)
    started = time.monotonic()
    done = agent.ok("proc_read", pid=pid, offset=0, min_bytes=1000, linger_s=1.0)
    assert time.monotonic() - started < 0.9
    assert (done["next_offset"], done["eof"]) == (3, True)


def test_stdout_and_stderr_are_tagged_in_one_offset_sequence(agent: AgentConnection) -> None:
    pid = agent.start("printf out1; sleep 0.2; printf err1 >&2; sleep 0.2; printf out2")
    chunks = agent.read_until_eof(pid)
    assert [(c["stream"], c["offset"], c["data"]) for c in chunks] == [
        ("stdout", 0, b"out1"),
        ("stderr", 4, b"err1"),
        ("stdout", 8, b"out2"),
    ]


def test_a_raw_read_sends_the_bytes_after_the_answer_and_sizes_in_the_chunks(
    agent: AgentConnection,
) -> None:
    pid = agent.start("printf 'out\\n'; sleep 0.2; printf 'err\\0' >&2; sleep 0.2; printf x")
    assert agent.output_until_eof(pid) == b"out\nerr\0x"
    read = agent.ok("proc_read", pid=pid, offset=1, raw=True)
    assert [(c["stream"], c["offset"], c["size"]) for c in read["chunks"]] == [
        ("stdout", 1, 3),
        ("stderr", 4, 4),
        ("stdout", 8, 1),
    ]
    assert "data" not in read["chunks"][0]
    assert (read["raw"], read["next_offset"], read["eof"]) == (b"ut\nerr\0x", 9, True)


def test_a_raw_read_sends_one_chunk_for_a_run_of_reads_of_one_stream(
    agent: AgentConnection,
) -> None:
    writer = (
        "import sys, time\n"
        "for i in range(3):\n"
        "    sys.stdout.buffer.write(bytes([65 + i]) * 40000); sys.stdout.flush(); time.sleep(0.1)"
    )
    pid = agent.start([sys.executable, "-c", writer])
    assert agent.output_until_eof(pid) == b"A" * 40000 + b"B" * 40000 + b"C" * 40000
    read = agent.ok("proc_read", pid=pid, offset=100, max_bytes=1 << 20, raw=True)
    assert [(c["stream"], c["offset"], c["size"]) for c in read["chunks"]] == [
        ("stdout", 100, 119900)
    ]
    assert read["raw"] == (b"A" * 40000 + b"B" * 40000 + b"C" * 40000)[100:]


def test_read_from_an_offset_cuts_the_chunk_it_falls_in(agent: AgentConnection) -> None:
    pid = agent.start("printf abcdefghij; exit 3")
    assert agent.output_until_eof(pid) == b"abcdefghij"

    middle = agent.ok("proc_read", pid=pid, offset=3)
    assert [(c["offset"], base64.b64decode(c["data"])) for c in middle["chunks"]] == [
        (3, b"defghij")
    ]
    assert (middle["next_offset"], middle["gap"], middle["eof"]) == (10, None, True)
    assert (middle["running"], middle["exit_code"]) == (False, 3)

    capped = agent.ok("proc_read", pid=pid, offset=3, max_bytes=2)
    assert [base64.b64decode(c["data"]) for c in capped["chunks"]] == [b"de"]
    assert (capped["next_offset"], capped["eof"]) == (5, False)

    at_end = agent.ok("proc_read", pid=pid, offset=10, wait_s=5)
    assert (at_end["chunks"], at_end["next_offset"], at_end["eof"]) == ([], 10, True)
    assert agent.error_kind("proc_read", pid=pid, offset=11) == "ValueError"


def test_ring_drops_the_oldest_output_and_reports_the_gap(agent: AgentConnection) -> None:
    total = RING_BYTES + 1_000_000
    writer = (
        f"import sys; pattern = bytes(range(251)) * ({total} // 251 + 1); "
        f"sys.stdout.buffer.write(pattern[:{total}])"
    )
    pid = agent.start([sys.executable, "-c", writer])
    deadline = time.monotonic() + 20
    while (info := agent.ok("proc_info", pid=pid))["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert info["output_end"] == total
    oldest = info["output_start"]
    assert total - RING_BYTES <= oldest <= total - RING_BYTES + 256 * 1024

    first = agent.ok("proc_read", pid=pid, offset=0, max_bytes=1024 * 1024)
    assert first["gap"] == {"from": 0, "to": oldest}
    assert first["chunks"][0]["offset"] == oldest
    received = b"".join(base64.b64decode(c["data"]) for c in first["chunks"])
    assert len(received) == 1024 * 1024 == first["next_offset"] - oldest
    rest = agent.read_until_eof(pid, offset=first["next_offset"])
    received += b"".join(c["data"] for c in rest)
    assert received == (bytes(range(251)) * (total // 251 + 1))[oldest:total]

    held = agent.ok("proc_read", pid=pid, offset=oldest, max_bytes=1)
    assert held["gap"] is None


# ----------------------------------------------------------------------------- stdin, signals


def test_stdin_data_and_eof(agent: AgentConnection) -> None:
    pid = agent.start(["cat"], stdin=True)
    assert agent.ok("proc_info", pid=pid)["stdin"] is True
    data = base64.b64encode(b"hello\n").decode()
    assert agent.ok("proc_stdin", pid=pid, data=data) == {"written": 6}
    assert agent.read_until(pid, b"hello\n") == (b"hello\n", 6)
    assert agent.ok("proc_stdin", pid=pid, data="", eof=True) == {"written": 0}
    assert agent.output_until_eof(pid) == b"hello\n"
    assert agent.ok("proc_info", pid=pid)["exit_code"] == 0
    assert agent.error_kind("proc_stdin", pid=pid, data=data) == "BrokenPipeError"


def test_stdin_of_a_process_started_without_it_is_a_value_error(agent: AgentConnection) -> None:
    pid = agent.start(["sleep", "30"])
    try:
        assert agent.error_kind("proc_stdin", pid=pid, data="aGk=") == "ValueError"
    finally:
        agent.ok("proc_signal", pid=pid, signal=9)


@pytest.mark.parametrize(("sent", "exit_code"), [("SIGTERM", 143), ("term", 143), (9, 137)])
def test_signal_by_name_or_number(agent: AgentConnection, sent: str | int, exit_code: int) -> None:
    pid = agent.start(["sleep", "30"])
    assert agent.ok("proc_signal", pid=pid, signal=sent) == {}
    agent.read_until_eof(pid)
    assert agent.ok("proc_info", pid=pid)["exit_code"] == exit_code
    assert agent.ok("proc_signal", pid=pid, signal=sent) == {}  # exited: nothing to do


def test_timeout_kills_the_whole_group_with_exit_code_124(agent: AgentConnection) -> None:
    pid = agent.start("sleep 30 & echo $!; sleep 30", timeout_s=0.5)
    started = time.monotonic()
    output = agent.output_until_eof(pid)
    assert time.monotonic() - started < 5
    info = agent.ok("proc_info", pid=pid)
    assert (info["running"], info["exit_code"]) == (False, 124)
    background = int(output)
    deadline = time.monotonic() + 5
    while not _process_gone(background):
        assert time.monotonic() < deadline, f"background job {background} survived the timeout"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- pty


def test_pty_is_a_controlling_terminal_of_the_given_size(agent: AgentConnection) -> None:
    info = agent.ok(
        "proc_start",
        cmd="stty size; tty; echo $TERM; echo via-ctty >/dev/tty",
        pty={"cols": 100, "rows": 40},
    )
    assert (info["pty"], info["stdin"]) == (True, True)
    chunks = agent.read_until_eof(info["pid"])
    assert {c["stream"] for c in chunks} == {"pty"}
    lines = b"".join(c["data"] for c in chunks).split(b"\r\n")
    assert lines[0] == b"40 100"
    assert lines[1].startswith(b"/dev/pts/")
    assert lines[2:4] == [b"xterm-256color", b"via-ctty"]


def test_pty_resize_changes_the_size_and_signals_winch(agent: AgentConnection) -> None:
    pid = agent.start(
        'trap "stty size" WINCH; echo ready; while :; do sleep 0.05; done',
        pty={"cols": 80, "rows": 24},
    )
    try:
        _, offset = agent.read_until(pid, b"ready")
        assert agent.ok("proc_resize", pid=pid, cols=120, rows=50) == {}
        agent.read_until(pid, b"50 120", offset)
    finally:
        agent.ok("proc_signal", pid=pid, signal="KILL")


def test_pty_stdin_is_typed_and_eof_is_ctrl_d(agent: AgentConnection) -> None:
    pid = agent.start(["cat"], pty={"cols": 80, "rows": 24})
    data = base64.b64encode(b"abc\n").decode()
    assert agent.ok("proc_stdin", pid=pid, data=data) == {"written": 4}
    output, _ = agent.read_until(pid, b"abc\r\nabc\r\n")  # the echo, then cat's copy
    assert output == b"abc\r\nabc\r\n"
    agent.ok("proc_stdin", pid=pid, data="", eof=True)
    agent.read_until_eof(pid)
    assert agent.ok("proc_info", pid=pid)["exit_code"] == 0


def test_resize_of_a_process_without_pty_is_a_value_error(agent: AgentConnection) -> None:
    pid = agent.start(["true"])
    assert agent.error_kind("proc_resize", pid=pid, cols=80, rows=24) == "ValueError"


# ----------------------------------------------------------------------------- errors and limits


@pytest.mark.parametrize(
    ("op", "params"),
    [
        ("proc_info", {}),
        ("proc_read", {"offset": 0}),
        ("proc_stdin", {"data": ""}),
        ("proc_signal", {"signal": "TERM"}),
        ("proc_resize", {"cols": 80, "rows": 24}),
    ],
)
def test_unknown_pid_is_process_lookup_error(
    agent: AgentConnection, op: str, params: dict[str, Any]
) -> None:
    assert agent.error_kind(op, pid=NO_SUCH_PID, **params) == "ProcessLookupError"


@pytest.mark.parametrize(
    ("op", "params"),
    [
        ("proc_start", {"cmd": []}),
        ("proc_start", {"cmd": ""}),
        ("proc_start", {"cmd": 5}),
        ("proc_start", {"cmd": ["a\0b"]}),
        ("proc_start", {"cmd": "true", "env": {"A": 1}}),
        ("proc_start", {"cmd": "true", "env": {"A=B": "c"}}),
        ("proc_start", {"cmd": "true", "stdin": 1}),
        ("proc_start", {"cmd": "true", "pty": {"cols": 0, "rows": 24}}),
        ("proc_start", {"cmd": "true", "pty": {"cols": 80}}),
        ("proc_start", {"cmd": "true", "timeout_s": -1}),
        ("proc_start", {"cmd": "true", "timeout_s": "1"}),
        ("proc_info", {"pid": "1"}),
        ("proc_read", {"pid": 1, "offset": -1}),
        ("proc_read", {"pid": 1, "offset": 0, "wait_s": 31}),
        ("proc_read", {"pid": 1, "offset": 0, "max_bytes": 0}),
        ("proc_read", {"pid": 1, "offset": 0, "max_bytes": 1024 * 1024 + 1}),
        ("proc_read", {"pid": 1, "offset": 0, "min_bytes": 0}),
        ("proc_read", {"pid": 1, "offset": 0, "linger_s": 1.5}),
        ("proc_read", {"pid": 1, "offset": 0, "raw": 1}),
        ("proc_stdin", {"pid": 1, "data": "not base64!"}),
        ("proc_stdin", {"pid": 1, "data": base64.b64encode(bytes(1024 * 1024 + 1)).decode()}),
        ("proc_signal", {"pid": 1, "signal": "NOPE"}),
        ("proc_signal", {"pid": 1, "signal": 0}),
        ("proc_resize", {"pid": 1, "cols": 1001, "rows": 24}),
    ],
)
def test_bad_params_are_value_errors(
    agent: AgentConnection, op: str, params: dict[str, Any]
) -> None:
    assert agent.error_kind(op, **params) == "ValueError"


def test_at_most_64_processes_run_at_once(fresh_agent: AgentConnection) -> None:
    pids = [fresh_agent.start(["sleep", "30"]) for _ in range(64)]
    assert fresh_agent.error_kind("proc_start", cmd=["true"]) == "BlockingIOError"
    running = [p for p in fresh_agent.ok("proc_list")["processes"] if p["running"]]
    assert sorted(p["pid"] for p in running) == sorted(pids)

    fresh_agent.ok("proc_signal", pid=pids[0], signal="KILL")
    fresh_agent.read_until_eof(pids[0])
    assert fresh_agent.output_until_eof(fresh_agent.start(["true"])) == b""


def test_only_the_64_most_recent_exited_processes_are_kept(fresh_agent: AgentConnection) -> None:
    pids = []
    for _ in range(70):
        pids.append(fresh_agent.start(["true"]))
        fresh_agent.read_until_eof(pids[-1])
    listed = fresh_agent.ok("proc_list")["processes"]
    assert [p["pid"] for p in listed] == pids[6:]
    assert fresh_agent.error_kind("proc_info", pid=pids[0]) == "ProcessLookupError"
    assert fresh_agent.ok("proc_info", pid=pids[6])["exit_code"] == 0


def test_the_longest_listing_fits_what_the_host_reads(fresh_agent: AgentConnection) -> None:
    """128 processes (64 running, 64 exited) with command lines of 50 000 control
    characters, each 6 bytes as JSON: the listing cuts each to 2048 characters and
    stays within the host's cap for it; the process's own info has it whole."""
    from forkd import limits

    arg = "\x01" * 50_000
    exited = [fresh_agent.start(["sh", "-c", "true", arg]) for _ in range(64)]
    for pid in exited:
        fresh_agent.read_until_eof(pid)
    running = [fresh_agent.start(["sh", "-c", "sleep 30", arg]) for _ in range(64)]
    listed = fresh_agent.ok("proc_list")["processes"]
    assert fresh_agent.last_line_bytes <= limits.AGENT_LISTING_LINE_MAX_BYTES
    assert [p["pid"] for p in listed] == exited + running
    for p in listed:
        assert p["cmd"][:3] in (["sh", "-c", "true"], ["sh", "-c", "sleep 30"])
        assert sum(map(len, p["cmd"])) == 2048 and p["cmd"][-1].endswith("\u2026")
    assert fresh_agent.ok("proc_info", pid=running[0])["cmd"][-1] == arg
    for pid in running:
        fresh_agent.ok("proc_signal", pid=pid, signal="KILL")


# ----------------------------------------------------------------------------- the ring itself


def _procs_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "forkd_procs_under_test", FILES / "forkd_procs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_ring_keeps_long_reads_as_they_came_and_merges_short_ones() -> None:
    procs = _procs_module()
    ring = procs.OutputRing(capacity=64 * 1024)
    long_reads = [bytes([i]) * procs.SMALL_READ_BYTES for i in range(3)]
    for data in long_reads:
        ring.append("stdout", data)
    for _ in range(100):
        ring.append("stdout", b"0123456789")
    ring.append("stderr", b"e")
    chunks = ring._chunks[ring._first :]
    assert [c.data is data for c, data in zip(chunks, long_reads, strict=False)] == [True] * 3
    assert [(c.stream, c.offset, len(c.data)) for c in chunks[3:]] == [
        ("stdout", 3 * procs.SMALL_READ_BYTES, 1000),
        ("stderr", 3 * procs.SMALL_READ_BYTES + 1000, 1),
    ]
    pieces, next_offset, gap = ring.read(0, 1 << 20)
    assert pieces[0].data is long_reads[0]  # a whole read is passed on without a copy
    assert b"".join(p.data for p in pieces) == b"".join(long_reads) + b"0123456789" * 100 + b"e"
    assert (next_offset, gap) == (ring.end, None)
    for _ in range(20):  # 80 KiB more through a 64 KiB ring: the oldest go
        ring.append("stdout", b"x" * procs.SMALL_READ_BYTES)
    assert ring.end - ring.start <= 64 * 1024
    pieces, next_offset, gap = ring.read(0, 1 << 20)
    assert gap == (0, ring.start) and next_offset == ring.end


def test_the_ring_lets_go_of_the_output_it_drops() -> None:
    # A dropped chunk's entry leaves the list only in a batch (over 1024 of them),
    # but its bytes must go at once: a 128 MiB stream read in ~128 KiB pieces never
    # made a batch, so the ring of each process (kept after the exit too) held all
    # of it, and a few such streams ran a 512 MiB guest out of memory (OOM-killed
    # or thrashing agent: the agent channel stopped answering).
    procs = _procs_module()
    capacity, read = 1 << 20, 64 * 1024
    ring = procs.OutputRing(capacity=capacity)
    tracemalloc.start()
    try:
        for i in range(256):  # 16 MiB through a 1 MiB ring, in long reads kept as they came
            ring.append("stdout", bytes([i % 251]) * read)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ring.end - ring.start <= capacity
    assert held < 2 * capacity, f"the ring holds {held} bytes for {capacity} of output"
    pieces, next_offset, gap = ring.read(0, 1 << 20)
    assert gap == (0, ring.start) and next_offset == ring.end
    assert b"".join(p.data for p in pieces) == b"".join(
        bytes([i % 251]) * read for i in range(256 - capacity // read, 256)
    )
