"""The guest agent (src/forkd/guest/files/forkd-agent.py), run on the host.

The agent is started as a subprocess serving a unix socket (plus one test each
for --stdio and --device on a pty); FORKD_AGENT_DRY_RESTORE=1 keeps `restore`
from touching the host's clock, RNG and hostname.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import itertools
import json
import os
import pty
import random
import select
import socket
import stat
import subprocess
import sys
import threading
import time
import tty
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from forkd.vmm.agent.client import AgentClient
from forkd.vmm.agent.lines import LineSplitter
from forkd.vmm.agent.ops import Guest

AGENT = Path(__file__).resolve().parents[2] / "src" / "forkd" / "guest" / "files" / "forkd-agent.py"
ENTROPY = base64.b64encode(os.urandom(32)).decode()


def _load_agent_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("forkd_agent_under_test", AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent_mod = _load_agent_module()
# The modules beside it (on sys.path once it is loaded), each holding its own part.
transport = agent_mod.transport
handlers = agent_mod.handlers
legacy = agent_mod.legacy


def _agent_env() -> dict[str, str]:
    return {**os.environ, "FORKD_AGENT_DRY_RESTORE": "1"}


class Client:
    """Minimal protocol client: raw line I/O plus request/answer matching by id."""

    def __init__(self, path: Path | socket.socket, timeout: float = 10.0) -> None:
        if isinstance(path, socket.socket):  # already connected
            self.sock = path
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(path))
        self.sock.settimeout(timeout)
        self._buf = b""
        self._ids = itertools.count(1000)
        self._early: dict[int, dict[str, Any]] = {}

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, op: str, **params: Any) -> int:
        req_id = next(self._ids)
        self.send_raw(json.dumps({"id": req_id, "op": op, **params}).encode() + b"\n")
        return req_id

    def read_line(self) -> bytes:
        while b"\n" not in self._buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("agent closed the connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def read_message(self) -> dict[str, Any]:
        return json.loads(self.read_line())

    def wait(self, req_id: int) -> dict[str, Any]:
        while req_id not in self._early:
            msg = self.read_message()
            self._early[msg["id"]] = msg
        return self._early.pop(req_id)

    def call(self, op: str, **params: Any) -> dict[str, Any]:
        """The whole answer (ok, result / error, kind)."""
        return self.wait(self.send(op, **params))

    def result(self, op: str, **params: Any) -> dict[str, Any]:
        msg = self.call(op, **params)
        assert msg["ok"] is True, msg
        return msg["result"]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def agent_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("agent") / "agent.sock"
    proc = subprocess.Popen([sys.executable, str(AGENT), "--socket", str(path)], env=_agent_env())
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                Client(path).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield path
    finally:
        _stop(proc)


@pytest.fixture
def agent(agent_socket: Path) -> Iterator[Client]:
    client = Client(agent_socket)
    yield client
    client.close()


# ----------------------------------------------------------------------------- ping


def test_ping(agent: Client) -> None:
    msg = agent.call("ping")
    assert msg["ok"] is True
    result = msg["result"]
    assert result["pong"] is True
    assert result["agent_version"] == "1"
    assert result["hostname"] == socket.gethostname()
    assert isinstance(result["pid"], int) and result["pid"] != os.getpid()
    assert isinstance(result["uptime_s"], float) and result["uptime_s"] > 0


# ----------------------------------------------------------------------------- exec


def test_exec_echo(agent: Client) -> None:
    result = agent.result("exec", argv=["echo", "hello", "world"])
    assert result["exit_code"] == 0
    assert result["stdout"] == "hello world\n"
    assert result["stderr"] == ""
    assert result["timed_out"] is False
    assert result["stdout_truncated"] is False and result["stderr_truncated"] is False
    assert isinstance(result["duration_ms"], float) and result["duration_ms"] >= 0


def test_exec_cwd_env_stdin(agent: Client, tmp_path: Path) -> None:
    script = 'pwd; echo "$FOO"; cat; echo "$HOME|$LANG|$PATH"; echo oops >&2'
    result = agent.result(
        "exec",
        argv=["sh", "-c", script],
        cwd=str(tmp_path),
        env={"FOO": "bar baz"},
        stdin="line one\nline two\n",
    )
    assert result["exit_code"] == 0
    lines = result["stdout"].splitlines()
    assert lines[0] == str(tmp_path)
    assert lines[1] == "bar baz"
    assert lines[2:4] == ["line one", "line two"]
    assert lines[4] == f"/root|C.UTF-8|{agent_mod.forkd_agent_command.BASE_ENV['PATH']}"
    assert result["stderr"] == "oops\n"


def test_exec_env_overrides_base_and_stdin_defaults_to_devnull(agent: Client) -> None:
    result = agent.result("exec", argv=["sh", "-c", 'echo "$HOME"; cat'], env={"HOME": "/tmp"})
    assert result["stdout"] == "/tmp\n"  # cat read EOF from /dev/null at once


def test_exec_nonzero_exit_and_signal(agent: Client) -> None:
    assert agent.result("exec", argv=["sh", "-c", "exit 7"])["exit_code"] == 7
    assert agent.result("exec", argv=["sh", "-c", "kill -9 $$"])["exit_code"] == 128 + 9


def test_exec_not_found_and_not_executable(agent: Client, tmp_path: Path) -> None:
    result = agent.result("exec", argv=["forkd-no-such-program"])
    assert result["exit_code"] == 127
    assert "forkd-no-such-program" in result["stderr"]
    assert "No such file" in result["stderr"]

    result = agent.result("exec", argv=["ls"], cwd=str(tmp_path / "missing"))
    assert result["exit_code"] == 127
    assert "missing" in result["stderr"]

    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    result = agent.result("exec", argv=[str(script)])
    assert result["exit_code"] == 126
    assert "Permission denied" in result["stderr"]


def test_exec_bad_params(agent: Client) -> None:
    params: dict[str, Any]
    for params in (
        {},
        {"argv": []},
        {"argv": "echo hi"},
        {"argv": ["echo", 1]},
        {"argv": ["true"], "timeout": 0},
        {"argv": ["true"], "timeout": "5"},
        {"argv": ["true"], "env": {"A": 1}},
        {"argv": ["echo", "a\0b"]},
        {"argv": ["true"], "cwd": "/\0tmp"},
    ):
        msg = agent.call("exec", **params)
        assert msg["ok"] is False, params
        assert msg["kind"] == "ValueError", msg


def test_exec_timeout_keeps_partial_output(agent: Client) -> None:
    start = time.monotonic()
    result = agent.result("exec", argv=["sh", "-c", "echo before; sleep 10"], timeout=0.5)
    elapsed = time.monotonic() - start
    assert result["timed_out"] is True
    assert result["exit_code"] == 124
    assert result["stdout"] == "before\n"
    assert elapsed < 2.0


def test_exec_timeout_kills_the_process_group(agent: Client) -> None:
    result = agent.result("exec", argv=["sh", "-c", "sleep 30 & echo $!; wait"], timeout=0.5)
    assert result["exit_code"] == 124
    pid = int(result["stdout"])
    deadline = time.monotonic() + 2
    while _is_running(pid):
        assert time.monotonic() < deadline, f"background sleep {pid} survived the timeout"
        time.sleep(0.02)


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_exec_timeout_answers_although_an_escaped_grandchild_holds_the_pipe(
    agent: Client,
) -> None:
    code = (
        "import subprocess, time\n"
        "subprocess.Popen(['sleep', '3'], start_new_session=True)\n"  # survives killpg
        "print('before', flush=True)\n"
        "time.sleep(10)\n"
    )
    start = time.monotonic()
    result = agent.result("exec", argv=[sys.executable, "-c", code], timeout=0.5)
    assert time.monotonic() - start < 2.0
    assert result["exit_code"] == 124
    assert result["stdout"] == "before\n"


def test_exec_background_job_does_not_hold_the_answer(agent: Client) -> None:
    start = time.monotonic()
    result = agent.result("exec", argv=["sh", "-c", "sleep 3 & echo done"], timeout=10)
    assert time.monotonic() - start < 2.0
    assert result["exit_code"] == 0
    assert result["timed_out"] is False
    assert result["stdout"] == "done\n"


def test_exec_background_writer_lives_on_after_the_answer(agent: Client, tmp_path: Path) -> None:
    # The background job writes to the exec's stdout long after the answer: its
    # pipe is still read (and dropped), so it is neither blocked nor killed by SIGPIPE.
    done = tmp_path / "done"
    job = f"(for i in $(seq 1 40); do echo line $i; sleep 0.02; done; echo ok > {done}) &"
    result = agent.result("exec", argv=["sh", "-c", f"{job} echo started"], timeout=10)
    assert result["stdout"].startswith("started\n")
    deadline = time.monotonic() + 10
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.read_text() == "ok\n"


def test_exec_stdin_larger_than_a_pipe_while_output_flows(agent: Client) -> None:
    # cat echoes stdin while it is still being written: both pipes must be
    # served at once, or the writer and cat block on each other.
    data = "".join(f"{i:07d}\n" for i in range(40_000))  # 320 KB, 5 pipe buffers
    result = agent.result("exec", argv=["cat"], stdin=data, timeout=20)
    assert result["exit_code"] == 0
    assert result["stdout"] == data


def test_exec_starts_no_thread_once_a_request_thread_is_idle(agent: Client) -> None:
    # A fork inherits the template's idle request threads; under TCG each new
    # guest thread is costly, so execs reuse them and start no thread of their own.
    # The request thread goes idle before its answer is out, so the next request finds
    # it; the one exec-drainer (pipes a finished command's children still hold) is the
    # agent's, started once in its life when a command is reaped before its pipes close.
    count = "import threading\n_n = [0]\n_start = threading.Thread.start\n"
    count += "_names = []\ndef _counted(self):\n    _names.append(self.name)\n"
    count += "    _n[0] += self.name != 'exec-drainer'\n    return _start(self)\n"
    count += "threading.Thread.start = _counted\n"
    assert agent.result("eval", code=count)["error"] is None
    before = agent.result("eval", code="_n[0]")["result"]
    for _ in range(5):
        assert agent.result("exec", argv=["sh", "-c", "echo hi; echo ho >&2"])["stdout"] == "hi\n"
    assert agent.result("exec", argv=["cat"], stdin="in\n", timeout=5)["stdout"] == "in\n"
    started = agent.result("eval", code="_names")["result"]
    assert agent.result("eval", code="_n[0]")["result"] == before, started


def _settled_fd_count(agent: Client) -> int:
    # The agent is shared by this module's tests: an earlier test's command may
    # still be closing its pipes, so read until the count holds still.
    fds = "import os\nlen(os.listdir('/proc/self/fd'))"
    counts = [int(agent.result("eval", code=fds)["result"])]
    deadline = time.monotonic() + 5
    while (len(counts) < 3 or len(set(counts[-3:])) > 1) and time.monotonic() < deadline:
        time.sleep(0.05)
        counts.append(int(agent.result("eval", code=fds)["result"]))
    return counts[-1]


def test_exec_stdin_that_cannot_be_encoded_starts_nothing_and_leaks_nothing(agent: Client) -> None:
    before = _settled_fd_count(agent)
    for _ in range(3):
        msg = agent.call("exec", argv=["cat"], stdin="abc\ud800", timeout=2)
        assert msg["ok"] is False and "surrogate" in msg["error"], msg
    # a leak is one descriptor (or three) per refused exec, and never closes
    assert _settled_fd_count(agent) <= before
    # and no `cat` was left waiting for a stdin nobody closes
    assert agent.result("exec", argv=["sh", "-c", "pgrep -x cat || true"])["stdout"] == ""


def test_request_threads_keep_no_finished_request_alive() -> None:
    # An idle request thread must not pin the last request it ran (a file write's
    # payload can be tens of MiB, and a template's snapshot would keep it).
    import gc
    import weakref

    class Payload(bytearray):
        pass

    workers = transport.Workers(keep=2)
    done = threading.Event()
    refs = []
    for _ in range(3):
        payload = Payload(1 << 20)
        refs.append(weakref.ref(payload))
        done.clear()

        def work(p: Payload = payload) -> None:  # holds the payload, as a request does
            len(p)
            done.set()

        workers.submit(work)
        del payload, work  # the worker alone holds them now
        assert done.wait(5)
        deadline = time.monotonic() + 5
        while workers.idle() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]


def test_exec_output_is_capped(agent: Client) -> None:
    assert handlers.forkd_exec.MAX_OUTPUT_BYTES == 1024 * 1024
    code = (  # odd-sized writes, so reads do not line up with the cap
        "import os\nfor _ in range(700):\n    os.write(1, b'x' * 3001)\nos.write(2, b'small')\n"
    )
    result = agent.result("exec", argv=[sys.executable, "-c", code])
    assert result["exit_code"] == 0
    assert result["stdout"] == "x" * handlers.forkd_exec.MAX_OUTPUT_BYTES
    assert result["stdout_truncated"] is True
    assert result["stderr"] == "small"
    assert result["stderr_truncated"] is False


# ----------------------------------------------------------------------------- eval


def test_eval_statements_expression_and_persistence(agent: Client) -> None:
    first = agent.result("eval", code="x = 41\ndef inc(v):\n    return v + 1\n")
    assert first == {
        "result": None,
        "error": None,
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "display": [],
        "display_truncated": False,
        "timed_out": False,
    }
    assert agent.result("eval", code="x + 1")["result"] == "42"
    assert agent.result("eval", code="y = inc(x)\ny")["result"] == "42"
    assert agent.result("eval", code="'a' * 3")["result"] == "'aaa'"
    assert agent.result("eval", code="__name__")["result"] == "'__main__'"


def test_eval_objects_with_thread_affinity_survive_between_calls(agent: Client) -> None:
    """sqlite3 refuses use from another thread: every eval must run on the same one."""
    agent.result("eval", code="import sqlite3\ndb = sqlite3.connect(':memory:')")
    agent.result(
        "eval", code="db.execute('create table t(v)'); db.execute('insert into t values (7)')"
    )
    res = agent.result("eval", code="db.execute('select v from t').fetchone()[0]")
    assert res["error"] is None, res["error"]
    assert res["result"] == "7"


def test_eval_exception_gives_traceback(agent: Client) -> None:
    result = agent.result("eval", code="def boom():\n    raise KeyError('nope')\nboom()")
    assert result["exit_code"] == 1
    assert result["result"] is None
    assert result["error"].startswith("Traceback (most recent call last):")
    assert "raise KeyError('nope')" in result["error"]  # user source lines are shown
    assert result["error"].rstrip().endswith("KeyError: 'nope'")
    assert "forkd-agent.py" not in result["error"]

    result = agent.result("eval", code="x = = 1")
    assert result["exit_code"] == 1
    assert "SyntaxError" in result["error"]

    result = agent.result("eval", code="raise SystemExit(3)")
    assert result["exit_code"] == 1
    assert "SystemExit: 3" in result["error"]
    assert agent.result("eval", code="1 + 1")["result"] == "2"  # still serving


def test_eval_captures_output(agent: Client) -> None:
    code = "import sys\nprint('hello')\nprint('warn', file=sys.stderr)\nprint('again')\n7"
    result = agent.result("eval", code=code)
    assert result["stdout"] == "hello\nagain\n"
    assert result["stderr"] == "warn\n"
    assert result["result"] == "7"
    assert result["exit_code"] == 0

    result = agent.result("eval", code="print('partial')\n1/0")
    assert result["stdout"] == "partial\n"
    assert result["exit_code"] == 1


# ----------------------------------------------------------------------------- files


def test_file_roundtrip(agent: Client, tmp_path: Path) -> None:
    blob = bytes(range(256)) * 64 + b"\x00\xff\n\r"
    path = tmp_path / "sub" / "dir" / "blob.bin"
    written = agent.result(
        "file_write", path=str(path), data=base64.b64encode(blob).decode(), mode=0o600
    )
    assert written == {"size": len(blob)}
    assert path.read_bytes() == blob
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind

    read = agent.result("file_read", path=str(path))
    assert read["size"] == len(blob)
    assert base64.b64decode(read["data"]) == blob

    agent.result("file_write", path=str(path), data=base64.b64encode(b"tail").decode(), append=True)
    assert path.read_bytes() == blob + b"tail"

    (path.parent / "a-link").symlink_to("blob.bin")
    (path.parent / "zdir").mkdir()
    entries = agent.result("file_list", path=str(path.parent))["entries"]
    assert [(e["name"], e["type"]) for e in entries] == [
        ("a-link", "symlink"),
        ("blob.bin", "file"),
        ("zdir", "dir"),
    ]
    blob_entry = entries[1]
    assert blob_entry["size"] == len(blob) + 4
    assert blob_entry["mode"] == 0o600
    assert abs(blob_entry["mtime"] - path.stat().st_mtime) < 1e-3

    assert agent.result("file_remove", path=str(path)) == {"removed": True}
    assert not path.exists()
    assert agent.call("file_read", path=str(path))["kind"] == "FileNotFoundError"
    assert agent.call("file_remove", path=str(path))["kind"] == "FileNotFoundError"


def test_file_write_default_mode_and_replaces_existing(agent: Client, tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_text("old content that is longer")
    agent.result("file_write", path=str(path), data=base64.b64encode(b"new").decode())
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_file_errors(agent: Client, tmp_path: Path) -> None:
    msg = agent.call("file_read", path=str(tmp_path))
    assert msg["ok"] is False and msg["kind"] == "IsADirectoryError"
    (tmp_path / "plain").write_text("x")
    msg = agent.call("file_list", path=str(tmp_path / "plain"))
    assert msg["ok"] is False and msg["kind"] == "NotADirectoryError"
    msg = agent.call("file_write", path=str(tmp_path / "x"), data="not base64!")
    assert msg["ok"] is False and msg["kind"] == "ValueError"


def test_file_remove_directory_needs_recursive(agent: Client, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "inner").mkdir(parents=True)
    (tree / "inner" / "f").write_text("x")
    msg = agent.call("file_remove", path=str(tree))
    assert msg["ok"] is False
    assert msg["kind"] == "IsADirectoryError"
    assert "recursive" in msg["error"]
    assert tree.exists()
    assert agent.result("file_remove", path=str(tree), recursive=True) == {"removed": True}
    assert not tree.exists()


@pytest.mark.parametrize("op", ["file_read", "file_write", "file_list", "file_remove"])
@pytest.mark.parametrize("bad", ["relative/path", "/tmp/nul\x00byte", 42, None])
def test_file_ops_reject_bad_paths(agent: Client, op: str, bad: object) -> None:
    msg = agent.call(op, path=bad, data="")
    assert msg["ok"] is False
    assert msg["kind"] == "ValueError"
    assert "path" in msg["error"]


def test_file_remove_refuses_root(agent: Client) -> None:
    for root in ("/", "//", "/./", "/.."):
        msg = agent.call("file_remove", path=root, recursive=True)
        assert msg["ok"] is False and msg["kind"] == "ValueError", root
    assert os.path.isdir("/bin")


# ----------------------------------------------------------------------------- transport


def test_requests_run_concurrently(agent: Client) -> None:
    slow = agent.send("exec", argv=["sleep", "1"])
    fast = agent.send("ping")
    first = agent.read_message()
    assert first["id"] == fast and first["ok"] is True
    second = agent.read_message()
    assert second["id"] == slow and second["result"]["exit_code"] == 0


def test_garbage_and_blank_lines_are_ignored(agent: Client) -> None:
    agent.send_raw(b"\n   \n")
    agent.send_raw(b"this is not json\n")
    agent.send_raw(b"[1, 2, 3]\n")
    agent.send_raw(b'{"op": "ping"}\n')  # no id
    agent.send_raw(b'{"id": "7", "op": "ping"}\n')  # id is not an int
    agent.send_raw(b'{"id": 3, "op": "pi')  # a stale partial line ...
    agent.send_raw(b"\n")  # ... ended by the host's resync newline
    agent.send_raw(b"\xff\xfe\n")  # not UTF-8
    req_id = agent.send("ping")
    msg = agent.read_message()  # nothing was answered before this
    assert msg["id"] == req_id
    assert msg["ok"] is True and msg["result"]["pong"] is True


def test_unknown_op_is_an_error_answer(agent: Client) -> None:
    msg = agent.call("no_such_op")
    assert msg == {
        "id": msg["id"],
        "ok": False,
        "error": "unknown op: 'no_such_op'",
        "kind": "ValueError",
    }
    assert agent.result("ping")["pong"] is True


def test_line_splitter_handles_split_and_oversized_lines() -> None:
    splitter = transport.LineSplitter(max_line=10)
    assert list(splitter.feed(b"ab")) == []
    assert list(splitter.feed(b"c\nde\nf")) == [(b"abc", None), (b"de", None)]
    assert list(splitter.feed(b"0123456789abc")) == []  # too long: dropped ...
    assert list(splitter.feed(b"def\nok\n")) == [(b"ok", None)]  # ... up to its newline


def test_a_payload_belongs_to_the_line_that_announced_it_however_it_is_cut() -> None:
    """A request's raw payload may hold newlines and what looks like a request:
    none of it is ever read as a line."""
    forged = b'{"id":9,"op":"exec","argv":["reboot"]}\n'
    payload = b"a\n" + forged + b"\n\nz"
    head = b'{"id": 7, "payload": %d, "op": "file_upload_write"}' % len(payload)
    stream = head + b"\n" + payload + b'{"id":8,"op":"ping"}\n'
    for cut in (1, 2, 5, 64, len(stream)):
        splitter = transport.LineSplitter()
        got = [r for i in range(0, len(stream), cut) for r in splitter.feed(stream[i : i + cut])]
        assert got == [(head, payload), (b'{"id":8,"op":"ping"}', None)], cut


def test_a_payload_over_the_cap_is_skipped_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "MAX_PAYLOAD_BYTES", 8)
    splitter = transport.LineSplitter()
    big = b'{"id":1,"op":"exec"}\n' * 2
    stream = b'{"id":7,"payload":%d,"op":"x"}\n' % len(big) + big + b'{"id":8}\n'
    assert list(splitter.feed(stream)) == [(b'{"id":8}', None)]


def test_stdio_mode() -> None:
    requests = [
        {"id": 1, "op": "ping"},
        {"id": 2, "op": "eval", "code": "import os\nos.system('echo stray')\n6 * 7"},
        {"id": 3, "op": "exec", "argv": ["echo", "hi"]},
    ]
    stdin = b"garbage\n" + b"".join(json.dumps(r).encode() + b"\n" for r in requests)
    proc = subprocess.run(
        [sys.executable, str(AGENT), "--stdio"],
        input=stdin,
        capture_output=True,
        env=_agent_env(),
        timeout=10,
        check=True,
    )
    answers = {m["id"]: m for m in map(json.loads, proc.stdout.splitlines())}
    assert sorted(answers) == [1, 2, 3]  # only protocol lines on stdout: "stray" went elsewhere
    assert answers[1]["result"]["pong"] is True
    assert answers[2]["result"]["result"] == "42"
    assert answers[3]["result"]["stdout"] == "hi\n"


def test_device_mode_on_a_pty() -> None:
    master, slave = pty.openpty()
    tty.setraw(slave)  # no echo, no newline translation: a plain byte pipe
    proc = subprocess.Popen(  # --tcp off: the guest's default would listen on the host's 8888
        [sys.executable, str(AGENT), "--device", os.ttyname(slave), "--tcp", "off"],
        env=_agent_env(),
    )
    try:
        os.write(master, b"\n" + json.dumps({"id": 9, "op": "ping"}).encode() + b"\n")
        buf = b""
        deadline = time.monotonic() + 10
        while buf.count(b"\n") < 2:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, "no answer from the agent on the pty"
            buf += os.read(master, 65536)
        first, second = (json.loads(x) for x in buf.split(b"\n")[:2])
        # A new agent process announces itself first: the host then knows that
        # requests sent to a crashed predecessor are lost.
        assert first == {"event": "started", "pid": proc.pid}
        assert second["id"] == 9 and second["result"]["pong"] is True
    finally:
        _stop(proc)
        os.close(master)
        os.close(slave)


def test_a_restarted_agent_ends_the_answer_its_predecessor_was_cut_off_in(
    tmp_path: Path,
) -> None:
    """After a crash mid-answer, the new agent's event is still read as a line by
    the host, wherever the answer was cut: in its line or in its raw bytes."""
    sent: list[bytes] = []
    conn = SimpleNamespace(send=lambda line, _req_id: sent.append(line))
    mark = tmp_path / "started"
    event = {"event": "started", "pid": os.getpid()}
    transport.announce(conn, str(mark))
    assert [json.loads(line) for line in sent] == [event] and mark.exists()  # a boot: no filler
    sent.clear()
    transport.announce(conn, str(mark))
    restart = b"".join(sent)

    raw = b"x\n" * 500
    cut_off = b'{"id":7,"raw":1000,"ok":true,"result":{"chunks":[{"size":1000}]}}\n' + raw
    for cut in (10, 40, 80, 500):  # in the id, in the line after the head, in the raw bytes
        splitter = LineSplitter({7: 4 << 20}.get)
        lines = list(splitter.feed(cut_off[:cut] + restart))
        events = [line.data for line in lines if line.req_id is None and line.data]
        assert [json.loads(data) for data in events] == [event], cut


def test_find_agent_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for dev, name in (("vport1p1", "org.qemu.guest_agent.0"), ("vport1p2", "agent")):
        (tmp_path / dev).mkdir()
        (tmp_path / dev / "name").write_text(name + "\n")
    monkeypatch.setattr(transport, "VIRTIO_PORTS_DIR", str(tmp_path))
    assert transport.find_agent_port() == "/dev/vport1p2"
    assert transport.find_agent_port("missing") is None


# ----------------------------------------------------------------------------- restore


def test_restore_dry_run_reseeds_random(agent: Client) -> None:
    seeded = repr(random.Random(1).random())
    # Control: without a restore the seeded sequence is reproduced in the agent.
    assert (
        agent.result("eval", code="import random\nrandom.seed(1)\nrandom.random()")["result"]
        == seeded
    )

    agent.result("eval", code="random.seed(1)")
    result = agent.result("restore", time_ns=time.time_ns(), entropy=ENTROPY, hostname="forkd-x")
    assert result["random_reseeded"] is True
    assert result["clock_set"] is False
    assert result["rng_reseeded"] is False
    assert result["hostname_set"] is False
    assert sorted(result["errors"]) == ["clock: dry run", "hostname: dry run", "rng: dry run"]
    assert agent.result("eval", code="random.random()")["result"] != seeded
    assert agent.result("ping")["hostname"] == socket.gethostname()


def test_a_seeded_restore_seeds_random_here_and_in_every_python_it_starts(
    tmp_path: Path,
) -> None:
    """A fork with a seed: the warm interpreter's random draws from it, and a new Python
    process does too (FORKD_SEED, and the seed directory's sitecustomize first on
    PYTHONPATH); the agent says it took it. Its own process: the seed stays in it."""
    path = tmp_path / "agent.sock"
    proc = subprocess.Popen([sys.executable, str(AGENT), "--socket", str(path)], env=_agent_env())
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                seeded = Client(path)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
        result = seeded.result(
            "restore", time_ns=time.time_ns(), entropy=ENTROPY, hostname="forkd-x", seed=7
        )
        assert result["seeded"] is True and result["random_reseeded"] is True
        expected = repr(random.Random(7).random())
        assert seeded.result("eval", code="import random\nrandom.random()")["result"] == expected
        ran = seeded.result("exec", argv=["sh", "-c", "echo $FORKD_SEED; echo $PYTHONPATH"])
        assert ran["stdout"].split() == ["7", "/opt/forkd/seed"]
        bad = seeded.call("restore", time_ns=time.time_ns(), entropy=ENTROPY, hostname="h", seed=-1)
        assert bad["ok"] is False and "'seed'" in bad["error"]
        seeded.close()
    finally:
        _stop(proc)


def test_the_seed_directory_seeds_random_and_runs_the_image_s_own_sitecustomize(
    tmp_path: Path,
) -> None:
    seed_dir = AGENT.parent / "seed"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIRS = True\n")
    code = "import random, builtins; print(random.random(), getattr(builtins, 'THEIRS', False))"
    env = {"FORKD_SEED": "7", "PYTHONPATH": f"{seed_dir}:{theirs}", "PATH": os.environ["PATH"]}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [repr(random.Random(7).random()), "True"]
    env["FORKD_SEED"] = "8"
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert other[0] != out[0]


def test_restore_rejects_bad_params(agent: Client) -> None:
    short = base64.b64encode(b"x" * 8).decode()
    for params in (
        {"time_ns": time.time_ns(), "entropy": short, "hostname": "h"},
        {"time_ns": "now", "entropy": ENTROPY, "hostname": "h"},
        {"time_ns": time.time_ns(), "entropy": ENTROPY},
    ):
        msg = agent.call("restore", **params)
        assert msg["ok"] is False and msg["kind"] == "ValueError", params


# ----------------------------------------------------------------------------- TCP (port 8888)
#
# The agent's TCP server runs in this process on a free loopback port (8888
# in the guest); `serial` is the virtio-serial protocol served in this
# process too, so both reach the same warm interpreter, as in the guest.


class TcpAgent:
    """The agent's TCP server on 127.0.0.1, a free port, with the given limits."""

    def __init__(self, **limits: Any) -> None:
        self.server = legacy.TcpServer("127.0.0.1", 0, **limits)
        self.addr = self.server.bind()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def connect(self, timeout: float = 10.0) -> socket.socket:
        return socket.create_connection(self.addr, timeout=timeout)

    def exchange(self, data: bytes) -> dict[str, Any]:
        """Send ``data`` as one connection's request; its one answer."""
        with self.connect() as sock:
            sock.sendall(data)
            return _one_answer(sock)

    def call(self, **request: Any) -> dict[str, Any]:
        return self.exchange(json.dumps(request).encode() + b"\n")


def _one_answer(sock: socket.socket) -> dict[str, Any]:
    """Read to EOF: exactly one JSON line, then the agent closed."""
    data = b""
    while chunk := sock.recv(1 << 20):
        data += chunk
    assert data.endswith(b"\n") and data.count(b"\n") == 1, data[:300]
    return json.loads(data)


def _ping_once_a_slot_is_free(agent: TcpAgent, within_s: float, refusal: str) -> None:
    """Ping until the agent takes the connection; until then it must refuse it."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            answer = agent.call(action="ping")
        except ConnectionResetError:  # refused before our request had arrived
            answer = {"ok": False, "error": refusal}
        if answer["ok"] is True:
            return
        assert answer["error"] == refusal
        assert time.monotonic() < deadline, "no connection slot came free"
        time.sleep(0.05)


@pytest.fixture
def tcp() -> Iterator[TcpAgent]:
    agent = TcpAgent()
    yield agent
    agent.server.close()


@pytest.fixture
def serial() -> Iterator[Client]:
    """The virtio-serial protocol, served in this process over a socketpair."""
    host_end, guest_end = socket.socketpair()
    conn = transport.Connection(guest_end.fileno(), guest_end.close)

    def serve() -> None:
        transport.serve_stream(conn, guest_end.fileno())
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    client = Client(host_end)
    yield client
    client.close()


def test_tcp_ping(tcp: TcpAgent) -> None:
    answer = tcp.call(action="ping")
    assert answer["ok"] is True and answer["pong"] is True
    assert answer["pid"] == os.getpid()
    assert answer["agent_version"] == "1"
    assert answer["hostname"] == socket.gethostname()
    # The original forkd agent's fields, which its clients read.
    assert answer["agent_lang"] == "python"
    assert answer["numpy_version"] == _installed("numpy")
    assert isinstance(answer["warmup_ready"], bool)
    assert "error" not in answer


def _installed(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not-installed"


def test_tcp_ping_says_warmup_ready_once_an_eval_ran(tcp: TcpAgent) -> None:
    handlers.WARMED_UP.clear()
    assert tcp.call(action="ping")["warmup_ready"] is False
    assert tcp.call(action="eval", code="1 / 0")["exit_code"] == 1  # a failed one does not count
    assert tcp.call(action="ping")["warmup_ready"] is False
    assert tcp.call(action="eval", code="import json")["exit_code"] == 0
    assert tcp.call(action="ping")["warmup_ready"] is True


def test_image_package_version_reads_metadata_directories(tmp_path: Path, monkeypatch) -> None:
    site = tmp_path / "site-packages"
    for meta in ("numpy_financial-1.0.dist-info", "numpy-1.24.2-py3.11.egg-info"):
        (site / meta).mkdir(parents=True)
    monkeypatch.setattr(handlers, "IMAGE_SITE_GLOBS", (str(tmp_path / "nothing*"), str(site)))
    assert handlers._image_package_version("numpy") == "1.24.2"
    (site / "numpy-1.24.2-py3.11.egg-info").rmdir()
    (site / "numpy-2.1.0.dist-info").mkdir()
    assert handlers._image_package_version("numpy") == "2.1.0"
    assert handlers._image_package_version("pandas") is None


def test_tcp_exec_takes_the_original_sdks_timeout(tcp: TcpAgent) -> None:
    # The original forkd SDK sends 'timeout', not 'timeout_secs': it is honoured.
    answer = tcp.call(action="exec", args=["sh", "-c", "echo before; sleep 10"], timeout=0.3)
    assert (answer["exit_code"], answer["timed_out"], answer["stdout"]) == (124, True, "before\n")
    answer = tcp.call(action="exec", args=["sleep", "0.5"], timeout=5)  # past the 0.3 above
    assert (answer["exit_code"], answer["timed_out"]) == (0, False)
    assert "error" not in answer
    same = tcp.call(action="exec", args=["true"], timeout=5, timeout_secs=5)
    assert same["exit_code"] == 0
    differ = tcp.call(action="exec", args=["true"], timeout=5, timeout_secs=6)
    assert differ["ok"] is False and "'timeout' differ" in differ["error"]


def test_tcp_exec_takes_the_http_apis_fields(tcp: TcpAgent, tmp_path: Path) -> None:
    answer = tcp.call(
        action="exec",
        args=["sh", "-c", 'pwd; echo "$FOO"; cat; echo oops >&2; exit 3'],
        cwd=str(tmp_path),
        env={"FOO": "bar"},
        stdin="from stdin\n",
        timeout_secs=10,
    )
    assert answer["ok"] is True, answer
    assert answer["stdout"] == f"{tmp_path}\nbar\nfrom stdin\n"
    assert answer["stderr"] == "oops\n"
    assert answer["exit_code"] == 3
    assert answer["timed_out"] is False
    assert answer["stdout_truncated"] is False and answer["stderr_truncated"] is False
    assert answer["duration_ms"] >= 0

    start = time.monotonic()
    answer = tcp.call(action="exec", args=["sh", "-c", "echo before; sleep 10"], timeout_secs=0.3)
    assert time.monotonic() - start < 3
    assert answer["ok"] is True
    assert (answer["exit_code"], answer["timed_out"], answer["stdout"]) == (124, True, "before\n")


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({}, "'args'"),
        ({"args": []}, "'args'"),
        ({"args": "echo hi"}, "'args'"),
        ({"argv": ["echo", "hi"]}, "'args'"),  # the serial channel's name is not the contract
        ({"args": ["true"], "timeout_secs": 0}, "'timeout_secs'"),
        ({"args": ["true"], "timeout_secs": "5"}, "'timeout_secs'"),
        ({"args": ["true"], "timeout_secs": 1e9}, "'timeout_secs'"),
        ({"args": ["true"], "timeout_secs": float("nan")}, "'timeout_secs'"),
        ({"args": ["true"], "env": {"A": 1}}, "'env'"),
        ({"args": ["true"], "timeout": 0}, "'timeout'"),
        ({"args": ["true"], "timeout": True}, "'timeout'"),
    ],
)
def test_tcp_exec_bad_fields_get_an_error_answer(
    tcp: TcpAgent, request_fields: dict[str, Any], named: str
) -> None:
    answer = tcp.call(action="exec", **request_fields)
    assert answer.keys() == {"ok", "error"} and answer["ok"] is False
    assert named in answer["error"]


def test_tcp_eval_shares_the_serial_channels_interpreter(tcp: TcpAgent, serial: Client) -> None:
    serial.result("eval", code="shared_by_channels = 'set over serial'")
    answer = tcp.call(action="eval", code="shared_by_channels")
    assert answer == {  # no 'error' key: the original forkd client takes one as a failure
        "ok": True,
        "result": "'set over serial'",
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "display": [],
        "display_truncated": False,
        "timed_out": False,
    }
    assert tcp.call(action="eval", code="shared_by_channels = 41\nprint('hi')")["stdout"] == "hi\n"
    assert serial.result("eval", code="shared_by_channels + 1")["result"] == "42"

    answer = tcp.call(action="eval", code="1 / 0")
    assert answer["ok"] is True and answer["exit_code"] == 1
    # As the original agent answered: one line, the whole traceback beside it.
    assert answer["error"] == "ZeroDivisionError: division by zero"
    assert answer["traceback"].startswith("Traceback (most recent call last):")
    assert answer["traceback"].rstrip().endswith(answer["error"])


def test_tcp_eval_honours_the_original_sdks_timeout(tcp: TcpAgent) -> None:
    start = time.monotonic()
    answer = tcp.call(action="eval", code=SLOW_LOOP, timeout=0.5)
    assert answer["ok"] is True and answer["timed_out"] is True
    assert time.monotonic() - start < 10
    refused = tcp.call(action="eval", code="1", timeout=1, timeout_s=2)
    assert refused["ok"] is False and "differ" in refused["error"]


# 30 s of Python, interruptible between its short sleeps (here an interrupt is raised
# in the eval thread between bytecodes; the guest's agent signals it, which ends a sleep).
SLOW_LOOP = "import time\nfor _ in range(3000):\n    time.sleep(0.01)"


def _eval_sent(tcp: TcpAgent, code: str) -> socket.socket:
    """An eval sent as the original SDK sends it (the write side closed), unanswered."""
    sock = tcp.connect(timeout=60)
    sock.sendall(json.dumps({"action": "eval", "code": code}).encode() + b"\n")
    sock.shutdown(socket.SHUT_WR)
    return sock


def test_an_eval_whose_client_left_is_interrupted_for_the_next(tcp: TcpAgent) -> None:
    """The client of a 30 s eval times out and closes its socket: the next eval does not
    wait for the abandoned one, which is interrupted."""
    gone = _eval_sent(tcp, SLOW_LOOP)
    time.sleep(0.5)  # its eval runs
    gone.close()
    start = time.monotonic()
    answer = tcp.call(action="eval", code="6 * 7")
    assert answer["result"] == "42"
    assert time.monotonic() - start < 5  # not the 29 s the abandoned eval had left


def test_a_client_that_leaves_while_its_eval_waits_never_stops_another(tcp: TcpAgent) -> None:
    """B's eval waits behind A's; B gives up: A's eval runs to its end (only B's eval is
    ever interrupted), and B's never holds the interpreter after."""
    waiting = _eval_sent(tcp, "import time\nfor _ in range(150):\n    time.sleep(0.01)\n'a done'")
    time.sleep(0.2)
    gone = _eval_sent(tcp, SLOW_LOOP)
    time.sleep(0.1)
    gone.close()
    with waiting:
        first = _one_answer(waiting)
    assert first["ok"] is True and first["result"] == "'a done'" and not first["timed_out"]
    start = time.monotonic()
    assert tcp.call(action="eval", code="'free'")["result"] == "'free'"
    assert time.monotonic() - start < 5  # B's 30 s loop was stopped once it ran


def test_an_eval_whose_client_still_waits_is_not_interrupted(tcp: TcpAgent) -> None:
    waiting = _eval_sent(tcp, "import time\ntime.sleep(1.5)\n'slept'")
    time.sleep(0.3)
    second = tcp.call(action="eval", code="'second'")  # waits its turn
    assert second["result"] == "'second'"
    with waiting:
        first = _one_answer(waiting)  # blanks before it, as JSON allows
    assert first["ok"] is True and first["result"] == "'slept'" and not first["timed_out"]


def test_tcp_exec_leaves_the_serial_channel_answering(tcp: TcpAgent, serial: Client) -> None:
    answers: list[dict[str, Any]] = []
    slow = threading.Thread(
        target=lambda: answers.append(tcp.call(action="exec", args=["sleep", "1.5"]))
    )
    slow.start()
    time.sleep(0.3)  # the TCP exec is running
    start = time.monotonic()
    assert serial.result("ping")["pong"] is True
    assert tcp.call(action="ping")["ok"] is True
    assert time.monotonic() - start < 0.5
    assert slow.is_alive()
    slow.join(10)
    assert answers[0]["exit_code"] == 0


def test_tcp_request_may_end_with_eof_instead_of_a_newline(tcp: TcpAgent) -> None:
    with tcp.connect() as sock:
        sock.sendall(b'{"action": "ping"}')
        sock.shutdown(socket.SHUT_WR)
        assert _one_answer(sock)["pong"] is True


def test_tcp_serves_one_request_per_connection(tcp: TcpAgent) -> None:
    second = {"action": "eval", "code": "tcp_second_request_ran = True"}
    with tcp.connect() as sock:
        sock.sendall(b'{"action": "ping"}\n' + json.dumps(second).encode() + b"\n")
        assert _one_answer(sock)["pong"] is True  # then EOF: the second line is never run
    answer = tcp.call(action="eval", code="'tcp_second_request_ran' in dir()")
    assert answer["result"] == "False"


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"this is not json\n", "not JSON"),
        (b"\xff\xfe\n", "not JSON"),
        (b"[1, 2, 3]\n", "JSON object"),
        (b"\n", "empty request"),
        (b"", "empty request"),  # connect, close the write side at once
        (b'{"op": "ping"}\n', "unknown action: None"),
        (b'{"action": 5}\n', "unknown action: 5"),
        (b'{"action": "nope"}\n', "unknown action: 'nope'"),
        # Only ping, exec and eval: no files, and above all no restore (clock, RNG, hostname).
        (b'{"action": "restore", "time_ns": 0, "entropy": "", "hostname": "x"}\n', "unknown"),
        (b'{"action": "file_read", "path": "/etc/hostname"}\n', "unknown"),
    ],
)
def test_tcp_malformed_requests_get_an_error_answer(
    tcp: TcpAgent, payload: bytes, error: str
) -> None:
    with tcp.connect() as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        answer = _one_answer(sock)
    assert answer.keys() == {"ok", "error"} and answer["ok"] is False
    assert error in answer["error"]
    assert tcp.call(action="ping")["ok"] is True  # still serving


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the agent may close before taking it all
        sock.sendall(data)


def _eval_line(code_padding: int) -> bytes:
    return json.dumps(
        {"action": "eval", "code": "tcp_big_ran = True  # " + "x" * code_padding}
    ).encode()


def test_tcp_request_over_the_size_cap_is_refused_unread(tcp: TcpAgent) -> None:
    cap = legacy.TCP_MAX_REQUEST_BYTES
    assert cap == 1024 * 1024
    at_cap = _eval_line(cap - len(_eval_line(0)))
    assert len(at_cap) == cap
    assert tcp.exchange(at_cap + b"\n")["exit_code"] == 0  # exactly the cap: served
    tcp.call(action="eval", code="del tcp_big_ran")

    with tcp.connect() as sock:
        sender = threading.Thread(
            target=_send_quietly,
            args=(
                sock,
                _eval_line(cap) + b"\n",
            ),
        )
        sender.start()  # the client may still be sending when the answer comes
        answer = _one_answer(sock)
        sender.join(10)
    assert answer == {"ok": False, "error": f"request larger than {cap} bytes"}
    assert tcp.call(action="eval", code="'tcp_big_ran' in dir()")["result"] == "False"

    # A line that never ends is cut at the cap, not buffered until the read timeout.
    with tcp.connect() as sock:
        sender = threading.Thread(
            target=_send_quietly,
            args=(
                sock,
                b"x" * (2 * cap),
            ),
        )
        start = time.monotonic()
        sender.start()
        answer = _one_answer(sock)
        assert time.monotonic() - start < legacy.TCP_READ_TIMEOUT_S / 2
        sender.join(10)
    assert answer == {"ok": False, "error": f"request larger than {cap} bytes"}


def test_tcp_silent_or_trickling_client_is_answered_and_closed() -> None:
    agent = TcpAgent(read_timeout_s=0.5)
    try:
        with agent.connect() as sock:
            start = time.monotonic()
            answer = _one_answer(sock)  # the client sends nothing
        assert answer == {"ok": False, "error": "no complete request within 0.5 s"}
        assert 0.4 < time.monotonic() - start < 3

        with agent.connect() as sock:  # a byte every 0.1 s never completes a line
            stop = threading.Event()

            def trickle() -> None:
                with contextlib.suppress(OSError):
                    while not stop.wait(0.1):
                        sock.send(b" ")

            threading.Thread(target=trickle, daemon=True).start()
            start = time.monotonic()
            answer = _one_answer(sock)
            stop.set()
        assert answer["error"] == "no complete request within 0.5 s"
        assert time.monotonic() - start < 3  # the deadline is for the whole request
    finally:
        agent.server.close()


def test_tcp_connections_beyond_the_cap_are_closed_at_once(serial: Client) -> None:
    assert legacy.TCP_MAX_CONNECTIONS == 16
    agent = TcpAgent(max_connections=3, read_timeout_s=30)
    holders = [agent.connect() for _ in range(3)]  # silent: each holds a slot
    try:
        with agent.connect() as extra:
            start = time.monotonic()
            answer = _one_answer(extra)
            assert time.monotonic() - start < 1
        assert answer == {"ok": False, "error": "too many connections (at most 3)"}
        assert serial.result("ping")["pong"] is True  # the serial channel is not held up
    finally:
        for sock in holders:
            sock.close()
    try:
        _ping_once_a_slot_is_free(agent, 5, "too many connections (at most 3)")
    finally:
        agent.server.close()


def test_tcp_client_that_never_reads_its_answer_gives_its_slot_back() -> None:
    agent = TcpAgent(max_connections=1, write_timeout_s=0.5)
    stuck = socket.socket()
    try:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(agent.addr)
        # Two MiB of control characters: about 12 MiB of JSON, more than the
        # kernel's buffers hold, so the agent's send would block for good.
        code = "import sys\nprint('\\x01' * 2**20)\nprint('\\x01' * 2**20, file=sys.stderr)"
        stuck.sendall(json.dumps({"action": "eval", "code": code}).encode() + b"\n")
        _ping_once_a_slot_is_free(agent, 10, "too many connections (at most 1)")
    finally:
        stuck.close()
        agent.server.close()


def test_tcp_listener_waits_for_a_busy_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(legacy, "TCP_BIND_RETRY_S", 0.05)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    server = legacy.TcpServer("127.0.0.1", port)
    server.start()  # cannot bind yet: retries instead of failing
    try:
        time.sleep(0.2)
        squatter.close()
        deadline = time.monotonic() + 5
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    sock.sendall(b'{"action": "ping"}\n')
                    assert _one_answer(sock)["pong"] is True
                    break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        server.close()


def test_tcp_address_defaults_to_port_8888_only_in_the_guest() -> None:
    parse = agent_mod.parse_args
    assert parse([]).tcp == ("0.0.0.0", 8888)  # the guest: init runs the agent bare
    assert parse(["--device", "/dev/vport0p1"]).tcp == ("0.0.0.0", 8888)
    assert parse(["--socket", "/tmp/a.sock"]).tcp is None
    assert parse(["--stdio"]).tcp is None
    assert parse(["--socket", "/tmp/a.sock", "--tcp", "127.0.0.1:9000"]).tcp == ("127.0.0.1", 9000)
    assert parse(["--tcp", "9000"]).tcp == ("0.0.0.0", 9000)
    assert parse(["--tcp", "off"]).tcp is None
    for bad in ("nope", "127.0.0.1:", "70000", "host:-1"):
        with pytest.raises(SystemExit):
            parse(["--tcp", bad])


def test_agent_process_serves_tcp_beside_its_channel(agent_socket: Path) -> None:
    """A real agent process: the unix-socket channel and TCP share one interpreter."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path = agent_socket.parent / "tcp-agent.sock"
    proc = subprocess.Popen(
        [sys.executable, str(AGENT), "--socket", str(path), "--tcp", f"127.0.0.1:{port}"],
        env=_agent_env(),
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except ConnectionRefusedError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
        with sock:
            sock.sendall(b'{"action": "eval", "code": "over_tcp = 6"}\n')
            assert _one_answer(sock)["exit_code"] == 0
        while True:
            try:
                channel = Client(path)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert channel.result("eval", code="over_tcp * 7")["result"] == "42"
        assert channel.result("ping")["pid"] == proc.pid
        channel.close()
    finally:
        _stop(proc)


def test_sdk_guest_agent_speaks_the_tcp_protocol(tcp: TcpAgent, serial: Client) -> None:
    from forkd.client import ControllerError, GuestAgent

    agent = GuestAgent(f"{tcp.addr[0]}:{tcp.addr[1]}")
    assert agent.ping()["pong"] is True
    ran = agent.exec(["sh", "-c", "cat; exit 2"], stdin="in", timeout=5)
    assert (ran.stdout, ran.exit_code, ran.timed_out) == ("in", 2, False)
    assert agent.exec(["sleep", "5"], timeout=0.2).timed_out is True
    serial.result("eval", code="sdk_shared = 20")
    assert agent.eval("sdk_shared + 22").result == "42"
    assert agent.eval("1/0").ok is False

    with pytest.raises(ControllerError) as refused:
        agent.exec([])
    assert refused.value.status == 400 and "'args'" in refused.value.message
    with pytest.raises(ValueError, match="HOST:PORT"):
        GuestAgent("10.201.0.6")

    tcp.server.close()
    with pytest.raises(ControllerError) as gone:
        agent.ping()
    assert gone.value.unreachable


def test_the_host_sends_upload_chunks_raw_to_an_agent_that_says_it_reads_them(
    agent_socket: Path, tmp_path: Path
) -> None:
    """The daemon's Guest and AgentClient against this agent: the open's answer
    says "payload", and chunks then go raw, newlines and forged requests in them."""
    target = tmp_path / "up.bin"
    chunks = [os.urandom(300_000), b'\n{"id":1,"op":"exec","argv":["touch","/x"]}\n' * 999]

    async def main() -> None:
        agent = AgentClient(agent_socket)
        await agent.connect(timeout=5)
        try:
            ops = Guest("upload-test", agent)
            opened = await ops.upload_open(str(target), chunks[0])
            assert opened["payload"] is True
            size = await ops.upload_write(
                opened["transfer_id"], len(chunks[0]), chunks[1], payload=True
            )
            assert size == sum(map(len, chunks))
            assert (await ops.ping())["pong"] is True  # the channel still reads lines
            await ops.upload_commit(opened["transfer_id"])
        finally:
            await agent.close()

    asyncio.run(main())
    assert target.read_bytes() == b"".join(chunks)
