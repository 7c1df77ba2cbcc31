"""The SDK (forkd.client) against the real daemon app over the fake VM driver.

The app runs under a real uvicorn on loopback (the ``server`` fixture), so the
SDK meets it as a user would. Tests of what the SDK sent read it from a
:class:`~tests.unit.conftest.RecordingTransport`; every answer is the app's.
Parsing and addressing that need no daemon are tested on their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.types import Receive, Scope, Send

import forkd
from forkd.client import (
    CommandResult,
    Controller,
    ControllerError,
    EvalResult,
    Sandbox,
    Snapshot,
    exit_code_of,
)
from forkd.controller.app import create_app
from forkd.controller.settings import Settings
from forkd.guest.image import find_image
from forkd.launcher import free_port
from tests.unit.conftest import TOKEN, RecordingTransport, Server, serving
from tests.unit.fakes import FakeDriver, FakeVM


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("FORKD_URL", "FORKD_TOKEN", "FORKD_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    # No token of a real daemon on this host: the default state dir is an empty one.
    monkeypatch.setenv("FORKD_STATE_DIR", str(tmp_path / "no-daemon-state"))


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


def vm_of(server: Server, sandbox_id: str) -> FakeVM:
    return next(vm for vm in server.driver.vms if vm.id == sandbox_id)


# -- address and token ----------------------------------------------------------


def test_default_url_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Controller().base_url == "http://127.0.0.1:8889"
    monkeypatch.setenv("FORKD_URL", "http://10.0.0.5:9000/")
    assert Controller().base_url == "http://10.0.0.5:9000"
    assert Controller("localhost:1234").base_url == "http://localhost:1234"


def test_auth_header_sources(
    server: Server, sent: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    def controller(**kw: Any) -> Controller:
        return Controller(server.url, transport=sent, **kw)

    with pytest.raises(ControllerError) as exc:
        controller().list_snapshots()
    assert exc.value.status == 401 and exc.value.message == "missing or wrong bearer token"
    assert "authorization" not in sent.last.headers
    assert controller().health() == {"ok": True}  # /healthz needs none

    assert controller(token=server.token).list_snapshots() == []
    assert sent.last.headers["authorization"] == f"Bearer {server.token}"

    monkeypatch.setenv("FORKD_TOKEN_FILE", str(server.token_file))  # "token\n": stripped
    assert controller().list_snapshots() == []
    assert sent.last.headers["authorization"] == f"Bearer {server.token}"

    monkeypatch.setenv("FORKD_TOKEN", "from-env")  # FORKD_TOKEN wins over the file
    with pytest.raises(ControllerError) as exc:
        controller().list_snapshots()
    assert exc.value.status == 401
    assert sent.last.headers["authorization"] == "Bearer from-env"

    # An explicit token wins over both, and so does an explicit token file.
    assert controller(token=server.token).list_snapshots() == []
    assert sent.last.headers["authorization"] == f"Bearer {server.token}"
    assert controller(token_file=server.token_file).list_snapshots() == []
    assert sent.last.headers["authorization"] == f"Bearer {server.token}"


class HeaderTap(httpx.MockTransport):
    """Answers every request 200 ``[]`` without any traffic, keeping what it was sent."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        super().__init__(self._answer)

    def _answer(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(200, json=[])

    def bearer_sent_to(self, url: str, **kw: Any) -> str | None:
        """The Authorization header a Controller of ``url`` sends, made with ``kw``."""
        with Controller(url, transport=self, **kw) as c:
            c.list_snapshots()
        return self.requests[-1].headers.get("authorization")


def _state_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, token: str) -> Path:
    """``FORKD_STATE_DIR`` pointing at a state dir whose daemon wrote ``token``."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "token").write_text(token + "\n")
    monkeypatch.setenv("FORKD_STATE_DIR", str(state))
    return state / "token"


def test_token_sources_in_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tap, local = HeaderTap(), "http://127.0.0.1:8889"
    assert tap.bearer_sent_to(local) is None  # no source at all: no header
    _state_token(monkeypatch, tmp_path, "from-state-dir")
    assert tap.bearer_sent_to(local) == "Bearer from-state-dir"  # 5: <state-dir>/token
    env_file = tmp_path / "env-file"
    env_file.write_text("from-env-file\n")
    monkeypatch.setenv("FORKD_TOKEN_FILE", str(env_file))
    assert tap.bearer_sent_to(local) == "Bearer from-env-file"  # 4 beats 5
    monkeypatch.setenv("FORKD_TOKEN", "from-env")
    assert tap.bearer_sent_to(local) == "Bearer from-env"  # 3 beats 4
    arg_file = tmp_path / "arg-file"
    arg_file.write_text("from-arg-file")
    assert tap.bearer_sent_to(local, token_file=arg_file) == "Bearer from-arg-file"  # 2 beats 3
    assert tap.bearer_sent_to(local, token="from-arg", token_file=arg_file) == "Bearer from-arg"


def test_an_unreadable_state_dir_token_is_skipped_without_a_word(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tap = HeaderTap()
    monkeypatch.setenv("FORKD_STATE_DIR", str(tmp_path / "missing"))
    assert tap.bearer_sent_to("http://127.0.0.1:8889") is None
    (tmp_path / "dir" / "token").mkdir(parents=True)  # not a file: cannot be read
    monkeypatch.setenv("FORKD_STATE_DIR", str(tmp_path / "dir"))
    assert tap.bearer_sent_to("http://127.0.0.1:8889") is None
    _state_token(monkeypatch, tmp_path, "")  # empty
    assert tap.bearer_sent_to("http://127.0.0.1:8889") is None
    (tmp_path / "state" / "token").write_bytes(b"\xff\xfe not text")
    assert tap.bearer_sent_to("http://127.0.0.1:8889") is None


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8889",
        "http://127.8.9.10:1",
        "localhost:8889",
        "http://LOCALHOST:1",
        "http://[::1]:8889",
        "unix:/run/forkd.sock",
        "unix:///run/forkd.sock",
    ],
)
def test_the_state_dir_token_goes_to_a_daemon_on_this_host(
    url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _state_token(monkeypatch, tmp_path, "local-secret")
    assert HeaderTap().bearer_sent_to(url) == "Bearer local-secret"


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.2.2:8889",
        "http://192.168.1.20:8889",
        "https://forkd.example.com",
        "http://127.0.0.1@evil.example:8889",
        "http://127.0.0.1\\@evil.example:8889",
        "http://evil.example#@127.0.0.1",
        "http://localhost.evil.example:8889",
        "http://127.0.0.1.evil.example",
        "http://0.0.0.0:8889",
        "http://[::ffff:10.0.0.1]:1",
    ],
)
def test_the_state_dir_token_never_leaves_the_host(
    url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _state_token(monkeypatch, tmp_path, "local-secret")
    for via in ({"base_url": url}, {"env": url}):
        tap = HeaderTap()
        if "env" in via:
            monkeypatch.setenv("FORKD_URL", url)
            with Controller(transport=tap) as c:
                c.list_snapshots()
        else:
            tap.bearer_sent_to(url)
        [request] = tap.requests
        # (httpx turns user info in a URL into Basic auth: that header is the URL's own.)
        assert not request.headers.get("authorization", "").startswith("Bearer")
        assert not any(b"local-secret" in value for _, value in request.headers.raw)
        assert "local-secret" not in str(request.url)
        assert request.url.host != "127.0.0.1"  # it went where the URL says: off this host
    # A token the user gives is theirs to send anywhere.
    if "@" not in urlsplit(url).netloc:  # (user info in the URL: httpx sends Basic auth)
        monkeypatch.setenv("FORKD_TOKEN", "given")
        assert HeaderTap().bearer_sent_to(url) == "Bearer given"


def test_a_local_daemon_accepts_the_state_dir_token(
    server: Server, sent: RecordingTransport, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with Controller(server.url, transport=sent) as c, pytest.raises(ControllerError) as exc:
        c.list_snapshots()
    assert exc.value.status == 401
    _state_token(monkeypatch, tmp_path, server.token)
    with Controller(server.url, transport=sent) as c:
        assert c.list_snapshots() == []
    assert sent.last.headers["authorization"] == f"Bearer {server.token}"


def test_unreadable_token_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FORKD_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ControllerError) as exc:
        Controller("http://x")
    assert exc.value.status == 0
    assert "token file" in exc.value.message


def test_connection_refused() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Controller(url, timeout=5) as c, pytest.raises(ControllerError) as exc:
        c.list_sandboxes()
    assert exc.value.status == 0 and exc.value.unreachable
    assert url in exc.value.message and "forkd serve" in exc.value.message
    assert str(exc.value).startswith("HTTP 0: ")


def test_unix_socket_missing(tmp_path: Path) -> None:
    c = Controller(f"unix:{tmp_path}/nope.sock")
    assert c.socket_path == f"{tmp_path}/nope.sock"
    with pytest.raises(ControllerError) as exc:
        c.health()
    assert exc.value.status == 0 and "forkd serve" in exc.value.message


def test_unix_socket_transport(settings: Settings, driver: FakeDriver, tmp_path: Path) -> None:
    app = create_app(settings, TOKEN, driver=driver)
    seen: list[tuple[str, bytes | None, bytes | None]] = []

    async def noting_headers(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            seen.append((scope["path"], headers.get(b"host"), headers.get(b"authorization")))
        await app(scope, receive, send)

    sock = str(tmp_path / "forkd.sock")
    with serving(noting_headers, uds=sock):
        for url in (f"unix:{sock}", f"unix://{sock}"):
            with Controller(url, token=TOKEN, timeout=5) as c:
                assert c.base_url == "http://forkd" and c.socket_path == sock
                assert c.health() == {"ok": True}
                assert c.list_snapshots() == []  # the token went along
    bearer = f"Bearer {TOKEN}".encode()
    assert seen == [("/healthz", b"forkd", bearer), ("/v1/snapshots", b"forkd", bearer)] * 2


# -- Controller: routes and bodies -------------------------------------------------


def test_routes_and_percent_encoding(ctl: Controller, sent: RecordingTransport, py: str) -> None:
    assert ctl.snapshot_info("py")["tag"] == "py"
    assert sent.last.url.raw_path == b"/v1/snapshots/py/info"
    # A name that is not a tag arrives whole in its one path segment, and is refused by name.
    with pytest.raises(ControllerError) as exc:
        ctl.snapshot_info("a b")
    assert sent.last.url.raw_path == b"/v1/snapshots/a%20b/info"
    assert exc.value.status == 400 and "'a b'" in exc.value.message
    # '/', '..' and '?' stay inside the segment: no other route or query is reached.
    with pytest.raises(ControllerError) as exc:
        ctl.get_sandbox("sb-1/../../x?y")
    assert sent.last.url.raw_path == b"/v1/sandboxes/sb-1%2F..%2F..%2Fx%3Fy"
    assert exc.value.status == 404
    with pytest.raises(ControllerError) as exc:
        ctl.delete_snapshot("a/b c")
    assert (sent.last.method, sent.last.url.raw_path) == ("DELETE", b"/v1/snapshots/a%2Fb%20c")
    assert exc.value.status == 404

    assert ctl.health() == {"ok": True}
    assert sent.last.url.path == "/healthz"
    assert ctl.version() == {"version": forkd.__version__, "api": "v1"}
    assert [s["tag"] for s in ctl.list_snapshots()] == ["py"]
    ctl.delete_snapshot("py")
    assert (sent.last.method, sent.last.url.raw_path) == ("DELETE", b"/v1/snapshots/py")
    assert ctl.list_snapshots() == []


def test_create_snapshot_omits_none(ctl: Controller, sent: RecordingTransport) -> None:
    info = ctl.create_snapshot("np", memory_mib=256)
    assert sent.last.method == "POST" and sent.last.url.path == "/v1/snapshots"
    assert sent.body() == {"tag": "np", "memory_mib": 256}
    assert (info["tag"], info["memory_mib"], info["image"]) == ("np", 256, "python")

    kernel = str(find_image("python").vmlinuz)  # extra keywords are sent as given
    info = ctl.create_snapshot(
        "np2", image="python", vcpus=2, setup="pip install x", warmup="x = 41", kernel=kernel
    )
    assert sent.body() == {
        "tag": "np2",
        "image": "python",
        "vcpus": 2,
        "setup": ["pip install x"],
        "warmup": "x = 41",
        "kernel": kernel,
    }
    assert info["memory_mib"] == 512  # not sent: the daemon's default


def test_spawn_branch_exec_bodies(
    ctl: Controller, sent: RecordingTransport, server: Server, py: str
) -> None:
    kids = ctl.spawn_sandboxes("py")
    assert sent.body() == {"snapshot_tag": "py", "n": 1}
    assert len(kids) == 1 and kids[0]["snapshot_tag"] == "py"
    more = ctl.spawn_sandboxes("py", n=2, memory_limit_mib=128, internet=False, timeout_secs=60)
    assert sent.body() == {
        "snapshot_tag": "py",
        "n": 2,
        "memory_limit_mib": 128,
        "internet": False,
        "timeout_secs": 60,
    }
    assert [k["memory_limit_mib"] for k in more] == [128, 128]
    assert all(k["expires_at_unix"] is not None for k in more)
    sid = kids[0]["id"]
    assert ctl.branch_sandbox(sid)["tag"] == f"branch-{sid}-1"
    assert sent.last.url.path == f"/v1/sandboxes/{sid}/branch"
    assert sent.body() == {}
    assert ctl.branch_sandbox(sid, tag="b1", mode="full")["branched_from"] == sid
    assert sent.body() == {"tag": "b1", "mode": "full"}

    r = ctl.exec_command(sid, ["echo", "hi"])
    assert (r["stdout"], r["stderr"], r["exit_code"], r["timed_out"]) == ("hi\n", "", 0, False)
    assert sent.body() == {"args": ["echo", "hi"], "timeout_secs": 30}
    ctl.exec_command(sid, ["true"], timeout_secs=5, cwd="/tmp", env={"A": "1"}, stdin=b"in")
    assert sent.body() == {
        "args": ["true"],
        "timeout_secs": 5,
        "cwd": "/tmp",
        "env": {"A": "1"},
        "stdin": "in",
    }
    # the HTTP timeout outlasts the command's
    assert sent.last.extensions["timeout"]["read"] == pytest.approx(35)

    assert ctl.eval_code(sid, "1+1")["result"] == "2"
    assert sent.body() == {"code": "1+1"}
    pong = ctl.ping_sandbox(sid)
    assert pong["pong"] is True and pong["hostname"] == sid
    assert sent.last.method == "POST" and sent.last.content == b""
    assert ctl.get_sandbox(sid)["id"] == sid
    assert {s["id"] for s in ctl.list_sandboxes()} == {sid, *(k["id"] for k in more)}
    ctl.kill_sandbox(sid)
    assert sent.last.method == "DELETE" and sent.last.url.path == f"/v1/sandboxes/{sid}"
    assert not vm_of(server, sid).alive
    with pytest.raises(ControllerError) as exc:
        ctl.get_sandbox(sid)
    assert exc.value.status == 404


def test_files(ctl: Controller, sent: RecordingTransport, sid: str) -> None:
    ctl.write_file(sid, "/tmp/a b&c.txt", "héllo")
    req = sent.last
    assert req.method == "PUT"
    assert req.url.path == f"/v1/sandboxes/{sid}/files"
    assert req.url.params["path"] == "/tmp/a b&c.txt"
    assert b"%26" in req.url.raw_path  # & is encoded in the query
    assert req.content == "héllo".encode()
    assert req.headers["content-type"] == "application/octet-stream"
    assert ctl.read_file(sid, "/tmp/a b&c.txt") == "héllo".encode()  # the daemon read the path
    ctl.write_file(sid, "/tmp/bin", b"\x00\xff")
    assert ctl.read_file(sid, "/tmp/bin") == b"\x00\xff"
    names = sorted(e["name"] for e in ctl.list_files(sid, "/tmp"))
    assert names == ["a b&c.txt", "bin"]
    assert sent.last.url.path == f"/v1/sandboxes/{sid}/files/list"
    ctl.remove_file(sid, "/tmp/bin")
    assert sent.last.method == "DELETE"
    assert dict(sent.last.url.params) == {"path": "/tmp/bin", "recursive": "false"}
    ctl.remove_file(sid, "/tmp/a b&c.txt", recursive=True)
    assert sent.last.url.params["recursive"] == "true"
    for path in ("/tmp/bin", "/tmp/a b&c.txt"):
        with pytest.raises(ControllerError) as exc:
            ctl.read_file(sid, path)
        assert exc.value.status == 404


def test_list_files_accepts_wrapped_entries() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"entries": [{"name": "x"}]})

    c = Controller("http://x", transport=httpx.MockTransport(handler))
    assert c.list_files("sb-1", "/") == [{"name": "x"}]


# -- ControllerError ------------------------------------------------------------------


def test_errors_of_the_daemon_are_parsed(ctl: Controller, py: str) -> None:
    with pytest.raises(ControllerError) as exc:
        ctl.get_sandbox("sb-9")
    message = "sandbox 'sb-9' not found"
    assert (exc.value.status, exc.value.message) == (404, message)
    assert exc.value.body == {"error": message}
    assert str(exc.value) == f"HTTP 404: {message}"
    assert not exc.value.unreachable
    with pytest.raises(ControllerError) as exc:
        ctl.create_snapshot("py")
    assert exc.value.status == 409 and "already exists" in exc.value.message
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("py", n=0)
    assert exc.value.status == 400 and exc.value.message.startswith("invalid request: n:")


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (404, {"error": "unknown sandbox sb-9"}, "unknown sandbox sb-9"),
        (409, {"error": "snapshot py exists"}, "snapshot py exists"),
        (503, {"error": "too many branches in flight"}, "too many branches in flight"),
        (422, {"detail": "field required"}, "field required"),
        (500, "Internal Server Error", "Internal Server Error"),
        (502, "", "Bad Gateway"),
    ],
)
def test_controller_error(status: int, body: Any, message: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, dict):
            return httpx.Response(status, json=body)
        return httpx.Response(status, text=body)

    c = Controller("http://x", transport=httpx.MockTransport(handler))
    with pytest.raises(ControllerError) as exc:
        c.get_sandbox("sb-9")
    assert exc.value.status == status
    assert exc.value.message == message
    assert exc.value.body == body
    assert str(exc.value) == f"HTTP {status}: {message}"
    assert not exc.value.unreachable


# -- results ----------------------------------------------------------------------------


def test_exit_code_of() -> None:
    assert exit_code_of({"exit_code": 3}) == 3
    assert exit_code_of({"exit_code": None, "timed_out": True}) == 124
    assert exit_code_of({"exit_code": None}) == -1


def test_a_timeout_is_what_the_daemon_says_else_exit_124() -> None:
    assert CommandResult("", "", 124).timed_out  # an answer without the field
    assert not CommandResult("", "", 124, raw={"timed_out": False}).timed_out
    assert CommandResult("", "", 0, raw={"timed_out": True}).timed_out


# -- Sandbox ----------------------------------------------------------------------------


def test_sandbox_spawn_and_commands(ctl: Controller, sent: RecordingTransport, py: str) -> None:
    sb = Sandbox("py", controller=ctl, memory_limit_mib=64)
    assert sent.body() == {"snapshot_tag": "py", "n": 1, "memory_limit_mib": 64}
    assert sb.info["snapshot_tag"] == sb.snapshot_tag == "py"
    assert sb.info["memory_limit_mib"] == 64
    assert [s["id"] for s in ctl.list_sandboxes()] == [sb.id]
    assert sb.controller is ctl

    r = sb.commands.run("exit 3", timeout=7)
    assert sent.body() == {"args": ["/bin/sh", "-c", "exit 3"], "timeout_secs": 7}
    assert r.stdout == "-c exit 3\n"  # the fake guest echoes the arguments it ran
    r = sb.commands.run(["exit", "3"])
    assert r == CommandResult(stdout="", stderr="exit 3\n", exit_code=3)
    assert not r.ok and not r.timed_out
    r = sb.commands.run(["exit", "124"])  # exiting 124 is not a timeout: the daemon says which
    assert r.exit_code == 124 and not r.timed_out
    r = sb.commands.run(["sleep", "5"], timeout=1)
    assert r.exit_code == 124 and r.timed_out and not r.ok
    r = sb.commands.run(["echo", "a", "b"], cwd="/", env={"X": "y"})
    assert r.stdout == "a b\n" and r.exit_code == 0 and r.ok
    assert sent.body()["args"] == ["echo", "a", "b"]
    assert sent.body()["cwd"] == "/" and sent.body()["env"] == {"X": "y"}

    ev = sb.eval("6*7")
    assert isinstance(ev, EvalResult) and (ev.result, ev.error, ev.exit_code) == ("42", None, 0)
    assert ev.ok
    ev = sb.eval("1/0")
    assert ev.result is None and "ZeroDivisionError" in (ev.error or "") and not ev.ok
    ev = sb.eval("print('hi')")
    assert (ev.stdout, ev.result) == ("hi\n", None)

    sb.files.write("/tmp/t.txt", "text")
    assert sb.files.read("/tmp/t.txt") == b"text"
    assert sb.files.read_text("/tmp/t.txt") == "text"
    assert [e["name"] for e in sb.files.list("/tmp")] == ["t.txt"]
    sb.files.remove("/tmp/t.txt")
    with pytest.raises(ControllerError) as exc:
        sb.files.read("/tmp/t.txt")
    assert exc.value.status == 404
    assert sb.ping()["pong"] is True
    assert sb.refresh()["state"] == "running"


def test_sandbox_context_manager_kills_once(
    ctl: Controller, sent: RecordingTransport, server: Server, py: str
) -> None:
    with Sandbox.create("py", controller=ctl) as sb:
        assert [s["id"] for s in ctl.list_sandboxes()] == [sb.id]
    assert sb.killed and ctl.list_sandboxes() == []
    deletes = [r.url.path for r in sent.requests if r.method == "DELETE"]
    assert deletes == [f"/v1/sandboxes/{sb.id}"]
    sb.kill()  # idempotent: no second request
    assert len([r for r in sent.requests if r.method == "DELETE"]) == 1
    assert vm_of(server, sb.id).events.count("kill") == 1

    # killing one that is already gone on the daemon is fine too
    other = Sandbox("py", controller=ctl)
    ctl.kill_sandbox(other.id)
    other.kill()
    assert other.killed


def test_sandbox_context_manager_kills_on_error(ctl: Controller, py: str) -> None:
    with pytest.raises(RuntimeError), Sandbox("py", controller=ctl) as sb:
        raise RuntimeError("boom")
    assert sb.killed
    with pytest.raises(ControllerError) as exc:
        ctl.get_sandbox(sb.id)
    assert exc.value.status == 404


def test_sandbox_without_controller_reads_the_environment(
    server: Server, py: str, ctl: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORKD_URL", server.url)
    monkeypatch.setenv("FORKD_TOKEN_FILE", str(server.token_file))
    with Sandbox("py") as sb:
        assert sb.eval("6*7").result == "42"
    assert ctl.list_sandboxes() == []
    with pytest.raises(RuntimeError, match="closed"):  # the controller it made is closed
        sb.controller.list_sandboxes()


def test_sandbox_attach_and_errors(ctl: Controller, sent: RecordingTransport, sid: str) -> None:
    n = len(sent.requests)
    sb = Sandbox(sandbox_id=sid, controller=ctl)
    assert [(r.method, r.url.path) for r in sent.requests[n:]] == [("GET", f"/v1/sandboxes/{sid}")]
    now = ctl.get_sandbox(sid)  # the same but for its last use, which that call was
    assert sb.id == sid and sb.info["last_active_at"] <= now.pop("last_active_at")
    assert {k: v for k, v in sb.info.items() if k != "last_active_at"} == now
    with pytest.raises(ControllerError) as exc:
        Sandbox(sandbox_id="sb-nope", controller=ctl)
    assert exc.value.status == 404
    with pytest.raises(ControllerError) as exc:
        Sandbox("nope", controller=ctl)
    assert exc.value.status == 404 and "nope" in exc.value.message
    with pytest.raises(ValueError):
        Sandbox(controller=ctl)
    with pytest.raises(ValueError):
        Sandbox("py", sandbox_id=sid, controller=ctl)
    with pytest.raises(TypeError):
        Sandbox(sandbox_id=sid, controller=ctl, n=2)
    assert [s["id"] for s in ctl.list_sandboxes()] == [sid]  # no error forked one


# -- Snapshot ---------------------------------------------------------------------------


def test_snapshot_fork_and_branch(ctl: Controller, sent: RecordingTransport) -> None:
    snap = Snapshot.create("tpl", controller=ctl, memory_mib=256, warmup="x = 41")
    assert sent.body() == {"tag": "tpl", "memory_mib": 256, "warmup": "x = 41"}
    assert snap.tag == "tpl" and snap.info["memory_mib"] == 256
    assert snap.branched_from is None and snap.pause_ms is None

    kids = snap.fork(3, timeout_secs=60)
    assert sent.body() == {"snapshot_tag": "tpl", "n": 3, "timeout_secs": 60}
    assert all(isinstance(k, Sandbox) for k in kids)
    assert [k.id for k in kids] == [s["id"] for s in ctl.list_sandboxes()]
    assert len({k.id for k in kids}) == 3
    assert all(k.controller is ctl for k in kids)
    assert kids[2].eval("x + 1").result == "42"  # the warm-up ran in the template

    branch = kids[0].branch()
    assert isinstance(branch, Snapshot)
    assert branch.tag == f"branch-{kids[0].id}-1"
    assert branch.branched_from == kids[0].id
    assert isinstance(branch.pause_ms, int) and branch.pause_ms >= 0
    named = kids[1].branch(tag="b2")
    assert named.tag == "b2" and sent.body() == {"tag": "b2"}

    grandkids = branch.fork(2)
    assert {g.info["snapshot_tag"] for g in grandkids} == {branch.tag}
    assert branch.refresh()["parent_tag"] == "tpl"
    branch.delete()
    with pytest.raises(ControllerError) as exc:
        ctl.snapshot_info(branch.tag)
    assert exc.value.status == 404


def test_snapshot_info_is_lazy(ctl: Controller, sent: RecordingTransport, sid: str) -> None:
    made = ctl.branch_sandbox(sid, tag="b")
    n = len(sent.requests)
    snap = Snapshot("b", controller=ctl)
    assert len(sent.requests) == n
    assert snap.pause_ms == made["pause_ms"] and snap.branched_from == sid
    assert len(sent.requests) == n + 1
    assert sent.last.url.path == "/v1/snapshots/b/info"
    assert snap.pause_ms == made["pause_ms"]
    assert len(sent.requests) == n + 1
