"""The SDK's commands (sb.commands.run/list/connect, CommandHandle) and process routes
against the real app under uvicorn over the fake driver (tests/unit/fake_processes.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from forkd.client import CommandHandle, CommandResult, Controller, ControllerError, Sandbox
from tests.unit.conftest import RecordingTransport, Server


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


@pytest.fixture
def sb(ctl: Controller, sid: str) -> Sandbox:
    return Sandbox.connect(sid, controller=ctl)


def test_connect_attaches_to_a_running_sandbox(ctl: Controller, sid: str) -> None:
    sb = Sandbox.connect(sid, controller=ctl)
    assert sb.id == sid and sb.info["state"] == "running"
    with pytest.raises(ControllerError) as exc:
        Sandbox.connect("sb-nope", controller=ctl)
    assert exc.value.status == 404


def test_run_with_callbacks_streams_as_output_comes(sb: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    r = sb.commands.run(
        ["count", "3", "0.3"], on_stdout=lambda s: seen.append((time.monotonic(), s))
    )
    assert isinstance(r, CommandResult)
    assert (r.stdout, r.stderr, r.exit_code) == ("1\n2\n3\n", "", 0)
    assert [s for _, s in seen] == ["1\n", "2\n", "3\n"]
    # The first came as it was written, not with the rest at the end: at least one of
    # the 0.3 s steps before the last (on a loaded host both may come late).
    assert seen[-1][0] - seen[0][0] > 0.25, [round(at - t0, 3) for at, _ in seen]
    errors: list[str] = []
    r = sb.commands.run(["exit", "4"], on_stderr=errors.append)
    assert r.exit_code == 4 and errors == ["exit 4\n"] and not r.ok


def test_run_without_callbacks_is_one_exec(sb: Sandbox, sent: RecordingTransport) -> None:
    r = sb.commands.run("echo hi", timeout=7, envs={"A": "1"}, env={"B": "2"})
    assert sent.last.url.path.endswith("/exec")
    assert sent.body() == {
        "args": ["/bin/sh", "-c", "echo hi"],
        "timeout_secs": 7,
        "env": {"B": "2", "A": "1"},
    }
    assert r.stdout == "-c echo hi\n"


def test_background_handle(sb: Sandbox, sent: RecordingTransport) -> None:
    h = sb.commands.run(["count", "4", "0.05"], background=True, envs={"X": "y"}, cwd="/tmp")
    assert isinstance(h, CommandHandle) and h.pid > 0
    start = next(
        sent.body(i)
        for i, r in enumerate(sent.requests)
        if r.url.path.endswith("/processes") and r.method == "POST"
    )
    assert start == {
        "cmd": ["count", "4", "0.05"],
        "stdin": False,
        "env": {"X": "y"},
        "cwd": "/tmp",
    }  # no timeout_s: a background command runs until it ends
    pieces = list(h)
    assert pieces[0] == ("1\n", None, None)
    assert "".join(p[0] or "" for p in pieces) == "1\n2\n3\n4\n"
    assert h.exit_code == 0 and h.stdout == "1\n2\n3\n4\n"
    assert h.wait().exit_code == 0  # read already: no second stream
    assert [p["pid"] for p in sb.commands.list()] == [h.pid]


def test_stdin_kill_and_connect(sb: Sandbox) -> None:
    cat = sb.commands.run(["cat"], background=True, stdin=True)
    cat.send_stdin("one\n")
    cat.send_stdin(b"two\n")
    cat.close_stdin()
    assert cat.wait().stdout == "one\ntwo\n"
    assert sb.commands.run(["cat"], stdin="fed\n", on_stdout=lambda _: None).stdout == "fed\n"
    with pytest.raises(ValueError, match="background"):
        sb.commands.run(["cat"], stdin=True)

    sleeper = sb.commands.run(["sleep", "30"], background=True)
    again = sb.commands.connect(sleeper.pid)
    assert again.info()["running"]
    assert sleeper.kill() is True
    assert again.wait().exit_code == 137
    assert sb.commands.kill(4242) is False
    with pytest.raises(ControllerError) as exc:
        sb.commands.connect(4242)
    assert exc.value.status == 404


def test_a_handle_resumes_where_it_left_off(sb: Sandbox) -> None:
    h = sb.commands.run(["count", "3", "0.05"], background=True)
    first = next(iter(h))
    assert first == ("1\n", None, None) and h.offset == 2
    late = sb.commands.connect(h.pid, offset=h.offset)
    assert late.wait().stdout == "2\n3\n"
    assert h.wait().stdout == "1\n2\n3\n"  # the first handle goes on from its own offset


def test_timeouts(sb: Sandbox, sent: RecordingTransport) -> None:
    r = sb.commands.run(["sleep", "30"], timeout=0.1, on_stdout=print)
    assert r.exit_code == 124 and r.timed_out
    sb.commands.run(["echo"], on_stdout=print)
    starts = [
        sent.body(i)
        for i, q in enumerate(sent.requests)
        if q.url.path.endswith("/processes") and q.method == "POST"
    ]
    assert [s.get("timeout_s") for s in starts] == [0.1, 30.0]


def test_controller_process_routes(ctl: Controller, sid: str) -> None:
    info = ctl.start_process(sid, ["cat"], pty=(80, 24))
    assert info["pty"] and info["stdin"]
    ctl.resize_process(sid, info["pid"], 100, 30)
    assert ctl.send_stdin(sid, info["pid"], "x\n", eof=True) == 2
    events = list(ctl.process_output(sid, info["pid"]))
    assert [(e.kind, e.data) for e in events] == [("pty", b"x\n"), ("exit", b"")]
    assert events[0].offset == 0 and events[0].next_offset == 2
    tail = list(ctl.process_output(sid, info["pid"], offset=2, follow=False))
    assert [e.kind for e in tail] == ["exit"]
    ctl.signal_process(sid, info["pid"], "TERM")  # an exited process: nothing to do
    with pytest.raises(ControllerError) as exc:
        list(ctl.process_output(sid, 4242))
    assert exc.value.status == 404


def test_a_keepalive_after_an_event_with_an_id_is_no_event() -> None:
    # httpx-sse turns a comment after an ``id:`` into an event with no data.
    body = (
        b'event: stdout\nid: 3\ndata: {"data":"hi\\n","encoding":"utf-8","offset":0,'
        b'"next_offset":3}\n\n: keepalive\n\nevent: exit\ndata: {"exit_code":0}\n\n'
    )

    def answer(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"Content-Type": "text/event-stream"})

    with Controller("http://127.0.0.1:1", token="t", transport=httpx.MockTransport(answer)) as c:
        events = list(c.process_output("sb-1", 7))
    assert [(e.kind, e.data, e.exit_code) for e in events] == [
        ("stdout", b"hi\n", None),
        ("exit", b"", 0),
    ]


def test_run_as_a_user_in_the_foreground_and_the_background(
    sb: Sandbox, sent: RecordingTransport
) -> None:
    assert sb.commands.run(["whoami"]).stdout == "root\n"  # no image USER: root
    assert "user" not in sent.body()  # none asked: none sent (the image's default)
    r = sb.commands.run(["whoami"], user="nobody")
    assert sent.body()["user"] == "nobody" and r.stdout == "nobody\n"
    streamed: list[str] = []
    r = sb.commands.run(["whoami"], user="1000:1000", on_stdout=streamed.append)
    assert sent.body(-2)["user"] == "1000:1000" and streamed == ["1000:1000\n"]
    h = sb.commands.run(["whoami"], background=True, user="daemon")
    assert sent.body()["user"] == "daemon" and h.wait().stdout == "daemon\n"


def test_a_terminal_as_a_user(sb: Sandbox, sent: RecordingTransport) -> None:
    pty = sb.pty.create(cmd=["whoami"], user="app")
    [started] = [
        r for r in sent.requests if r.method == "POST" and r.url.path.endswith("/processes")
    ]
    assert json.loads(started.content) == {
        "cmd": ["whoami"],
        "stdin": False,
        "user": "app",
        "pty": {"cols": 80, "rows": 24},
    }
    screen = [ev.data for ev in sb.commands.connect(pty.pid).events() if ev.kind == "pty"]
    assert screen == [b"app\n"]
