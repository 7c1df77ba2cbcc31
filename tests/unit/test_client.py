"""The SDK (forkd.client) and the daemon CLI (forkd.cli) against a fake daemon.

The fake daemon is an ``httpx.MockTransport`` handler implementing just enough of
docs/API.md, recording every request it sees.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from forkd import cli
from forkd.cli import render
from forkd.client import (
    CommandResult,
    Controller,
    ControllerError,
    EvalResult,
    Sandbox,
    Snapshot,
)

# -- the fake daemon --------------------------------------------------------------


class FakeDaemon:
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.requests: list[httpx.Request] = []
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.files: dict[tuple[str, str], bytes] = {}
        self.seq = 0
        self.branch_seq: dict[str, int] = {}
        self.eval_answer: dict[str, Any] | None = None
        self.transport = httpx.MockTransport(self.handle)

    # helpers for tests
    def add_snapshot(self, tag: str, **extra: Any) -> dict[str, Any]:
        info = {
            "tag": tag,
            "dir": f"/var/lib/forkd/snapshots/{tag}",
            "created_at_unix": 1780000000,
            "status": "ready",
            "bootable": True,
            "memory_mib": 512,
            "image": "python",
            **extra,
        }
        self.snapshots[tag] = info
        return info

    def add_sandbox(self, tag: str) -> dict[str, Any]:
        self.seq += 1
        sid = f"sb-67a1b3-{self.seq:04d}"
        info = {
            "id": sid,
            "snapshot_tag": tag,
            "netns": None,
            "guest_addr": None,
            "created_at_unix": 1780000123,
            "pid": 31000 + self.seq,
            "memory_limit_mib": None,
            "state": "running",
        }
        self.sandboxes[sid] = info
        return info

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]

    def body(self, i: int = -1) -> Any:
        return json.loads(self.requests[i].content)

    # routing
    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path  # decoded
        if path == "/healthz":
            return httpx.Response(200, json={"ok": True})
        if self.token is not None and request.headers.get("authorization") != (
            f"Bearer {self.token}"
        ):
            return self.error(401, "missing or wrong bearer token")
        parts = [p for p in request.url.raw_path.decode().split("?")[0].split("/") if p]
        from urllib.parse import unquote

        parts = [unquote(p) for p in parts]
        m = request.method
        try:
            return self.route(m, parts, request)
        except KeyError as exc:
            return self.error(404, f"unknown {exc.args[0]}")

    @staticmethod
    def error(status: int, message: str) -> httpx.Response:
        return httpx.Response(status, json={"error": message})

    def route(self, m: str, parts: list[str], req: httpx.Request) -> httpx.Response:
        if parts == ["version"]:
            return httpx.Response(200, json={"version": "0.1.0", "api": "v1"})
        if parts[:2] == ["v1", "snapshots"]:
            return self.route_snapshots(m, parts[2:], req)
        if parts[:2] == ["v1", "sandboxes"]:
            return self.route_sandboxes(m, parts[2:], req)
        return self.error(404, "no such route")

    def route_snapshots(self, m: str, rest: list[str], req: httpx.Request) -> httpx.Response:
        if not rest and m == "GET":
            return httpx.Response(200, json=list(self.snapshots.values()))
        if not rest and m == "POST":
            body = json.loads(req.content)
            tag = body.get("tag", "")
            if not tag or "/" in tag:
                return self.error(400, f"bad tag {tag!r}")
            if tag in self.snapshots:
                return self.error(409, f"snapshot {tag} exists")
            info = self.add_snapshot(tag)
            for k in ("memory_mib", "image"):
                if k in body:
                    info[k] = body[k]
            return httpx.Response(201, json=info)
        tag = rest[0]
        if tag not in self.snapshots:
            raise KeyError(f"snapshot {tag}")
        if rest[1:] == ["info"] and m == "GET":
            info = dict(self.snapshots[tag])
            src = info.get("branched_from")
            parent = self.sandboxes.get(src, {}).get("snapshot_tag") if src else None
            info.update(parent_tag=info.get("parent_tag", parent), memory_physical_bytes=4096)
            return httpx.Response(200, json=info)
        if len(rest) == 1 and m == "DELETE":
            del self.snapshots[tag]
            return httpx.Response(204)
        return self.error(405, "method not allowed")

    def route_sandboxes(self, m: str, rest: list[str], req: httpx.Request) -> httpx.Response:
        if not rest and m == "GET":
            return httpx.Response(200, json=list(self.sandboxes.values()))
        if not rest and m == "POST":
            body = json.loads(req.content)
            tag = body["snapshot_tag"]
            if tag not in self.snapshots:
                raise KeyError(f"snapshot {tag}")
            kids = [self.add_sandbox(tag) for _ in range(body.get("n", 1))]
            for k in kids:
                k["memory_limit_mib"] = body.get("memory_limit_mib")
            return httpx.Response(201, json=kids)
        sid = rest[0]
        if sid not in self.sandboxes:
            raise KeyError(f"sandbox {sid}")
        sub = rest[1:]
        if not sub and m == "GET":
            return httpx.Response(200, json=self.sandboxes[sid])
        if not sub and m == "DELETE":
            del self.sandboxes[sid]
            return httpx.Response(204)
        if sub == ["ping"] and m == "POST":
            return httpx.Response(200, json={"pong": True, "pid": 1})
        if sub == ["branch"] and m == "POST":
            body = json.loads(req.content) if req.content else {}
            if body.get("mode", "full") != "full":
                return self.error(400, f"unknown mode {body['mode']!r}")
            seq = self.branch_seq[sid] = self.branch_seq.get(sid, 0) + 1
            tag = body.get("tag") or f"branch-{sid}-{seq}"
            if tag in self.snapshots:
                return self.error(409, f"snapshot {tag} exists")
            info = self.add_snapshot(tag, branched_from=sid, pause_ms=212)
            return httpx.Response(201, json=info)
        if sub == ["exec"] and m == "POST":
            return httpx.Response(200, json=self.run(json.loads(req.content)))
        if sub == ["eval"] and m == "POST":
            code = json.loads(req.content)["code"]
            if self.eval_answer is not None:
                return httpx.Response(200, json=self.eval_answer)
            try:
                result = repr(eval(code, {}))  # the fake's "interpreter"
                return httpx.Response(200, json={"result": result, "error": None, "exit_code": 0})
            except Exception as exc:
                err = f"Traceback (most recent call last):\n{type(exc).__name__}: {exc}"
                return httpx.Response(200, json={"result": None, "error": err, "exit_code": 1})
        if sub == ["files"]:
            path = req.url.params["path"]
            if m == "PUT":
                self.files[(sid, path)] = req.content
                return httpx.Response(204)
            if m == "GET":
                if (sid, path) not in self.files:
                    return self.error(404, f"no such file {path}")
                return httpx.Response(
                    200,
                    content=self.files[(sid, path)],
                    headers={"content-type": "application/octet-stream"},
                )
            if m == "DELETE":
                self.files.pop((sid, path), None)
                return httpx.Response(204)
        if sub == ["files", "list"] and m == "GET":
            d = req.url.params["path"].rstrip("/") + "/"
            entries = [
                {"name": p[len(d) :], "type": "file", "size": len(v), "mode": 0o644, "mtime": 0}
                for (s, p), v in self.files.items()
                if s == sid and p.startswith(d)
            ]
            return httpx.Response(200, json=entries)
        return self.error(405, "method not allowed")

    @staticmethod
    def run(body: dict[str, Any]) -> dict[str, Any]:
        args = body["args"]
        if args[0] == "echo":
            return {"stdout": " ".join(args[1:]) + "\n", "stderr": "", "exit_code": 0}
        if args[:2] == ["/bin/sh", "-c"] and args[2].startswith("exit "):
            return {"stdout": "", "stderr": "bye\n", "exit_code": int(args[2].split()[1])}
        return {"stdout": json.dumps(args), "stderr": "", "exit_code": 0}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FORKD_URL", "FORKD_TOKEN", "FORKD_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def daemon() -> FakeDaemon:
    d = FakeDaemon()
    d.add_snapshot("py")
    return d


@pytest.fixture
def ctl(daemon: FakeDaemon) -> Controller:
    return Controller("http://forkd.test:8889", transport=daemon.transport)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Controller ---------------------------------------------------------------------


def test_default_url_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Controller().base_url == "http://127.0.0.1:8889"
    monkeypatch.setenv("FORKD_URL", "http://10.0.0.5:9000/")
    assert Controller().base_url == "http://10.0.0.5:9000"
    assert Controller("localhost:1234").base_url == "http://localhost:1234"


def test_routes_and_percent_encoding(daemon: FakeDaemon, ctl: Controller) -> None:
    daemon.add_snapshot("a/b c")  # the fake accepts any tag; the daemon would say 400
    info = ctl.snapshot_info("a/b c")
    assert info["tag"] == "a/b c"
    assert daemon.last.url.raw_path == b"/v1/snapshots/a%2Fb%20c/info"
    with pytest.raises(ControllerError) as exc:
        ctl.get_sandbox("sb-1/../../x?y")
    assert daemon.last.url.raw_path == b"/v1/sandboxes/sb-1%2F..%2F..%2Fx%3Fy"
    assert exc.value.status == 404

    assert ctl.health() == {"ok": True}
    assert daemon.last.url.path == "/healthz"
    assert ctl.version()["api"] == "v1"
    assert [s["tag"] for s in ctl.list_snapshots()] == ["py", "a/b c"]
    ctl.delete_snapshot("a/b c")
    assert (daemon.last.method, daemon.last.url.raw_path) == (
        "DELETE",
        b"/v1/snapshots/a%2Fb%20c",
    )
    assert "a/b c" not in daemon.snapshots


def test_auth_header_sources(
    daemon: FakeDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon.token = "s3cret"
    with pytest.raises(ControllerError) as exc:
        Controller("http://x", transport=daemon.transport).list_snapshots()
    assert exc.value.status == 401
    assert "authorization" not in daemon.last.headers
    # /healthz needs none
    assert Controller("http://x", transport=daemon.transport).health() == {"ok": True}

    Controller("http://x", token="s3cret", transport=daemon.transport).list_snapshots()
    assert daemon.last.headers["authorization"] == "Bearer s3cret"

    tf = tmp_path / "token"
    tf.write_text("s3cret\n")
    monkeypatch.setenv("FORKD_TOKEN_FILE", str(tf))
    Controller("http://x", transport=daemon.transport).list_snapshots()
    assert daemon.last.headers["authorization"] == "Bearer s3cret"

    monkeypatch.setenv("FORKD_TOKEN", "from-env")  # FORKD_TOKEN wins over the file
    with pytest.raises(ControllerError):
        Controller("http://x", transport=daemon.transport).list_snapshots()
    assert daemon.last.headers["authorization"] == "Bearer from-env"

    # explicit token wins over both
    Controller("http://x", token="s3cret", transport=daemon.transport).list_snapshots()
    assert daemon.last.headers["authorization"] == "Bearer s3cret"
    # explicit token_file too
    Controller("http://x", token_file=tf, transport=daemon.transport).list_snapshots()
    assert daemon.last.headers["authorization"] == "Bearer s3cret"


def test_unreadable_token_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FORKD_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ControllerError) as exc:
        Controller("http://x")
    assert exc.value.status == 0
    assert "token file" in exc.value.message


def test_create_snapshot_omits_none(daemon: FakeDaemon, ctl: Controller) -> None:
    ctl.create_snapshot("np", memory_mib=256)
    assert daemon.last.method == "POST" and daemon.last.url.path == "/v1/snapshots"
    assert daemon.body() == {"tag": "np", "memory_mib": 256}
    ctl.create_snapshot(
        "np2", image="python", vcpus=2, setup="pip install x", warmup="import x", kernel="/k"
    )
    assert daemon.body() == {
        "tag": "np2",
        "image": "python",
        "vcpus": 2,
        "setup": ["pip install x"],
        "warmup": "import x",
        "kernel": "/k",
    }


def test_spawn_branch_exec_bodies(daemon: FakeDaemon, ctl: Controller) -> None:
    kids = ctl.spawn_sandboxes("py")
    assert daemon.body() == {"snapshot_tag": "py", "n": 1}
    assert len(kids) == 1
    ctl.spawn_sandboxes("py", n=2, memory_limit_mib=128, internet=False, timeout_secs=60)
    assert daemon.body() == {
        "snapshot_tag": "py",
        "n": 2,
        "memory_limit_mib": 128,
        "internet": False,
        "timeout_secs": 60,
    }
    sid = kids[0]["id"]
    ctl.branch_sandbox(sid)
    assert daemon.last.url.path == f"/v1/sandboxes/{sid}/branch"
    assert daemon.body() == {}
    ctl.branch_sandbox(sid, tag="b1", mode="full")
    assert daemon.body() == {"tag": "b1", "mode": "full"}

    r = ctl.exec_command(sid, ["echo", "hi"])
    assert r == {"stdout": "hi\n", "stderr": "", "exit_code": 0}
    assert daemon.body() == {"args": ["echo", "hi"], "timeout_secs": 30}
    ctl.exec_command(sid, ["true"], timeout_secs=5, cwd="/tmp", env={"A": "1"}, stdin=b"in")
    assert daemon.body() == {
        "args": ["true"],
        "timeout_secs": 5,
        "cwd": "/tmp",
        "env": {"A": "1"},
        "stdin": "in",
    }
    # the HTTP timeout outlasts the command's
    assert daemon.last.extensions["timeout"]["read"] == pytest.approx(35)

    assert ctl.eval_code(sid, "1+1")["result"] == "2"
    assert daemon.body() == {"code": "1+1"}
    assert ctl.ping_sandbox(sid)["pong"] is True
    assert daemon.last.method == "POST"
    assert ctl.get_sandbox(sid)["id"] == sid
    assert {s["id"] for s in ctl.list_sandboxes()} == set(daemon.sandboxes)
    ctl.kill_sandbox(sid)
    assert daemon.last.method == "DELETE" and sid not in daemon.sandboxes


def test_files(daemon: FakeDaemon, ctl: Controller) -> None:
    sid = ctl.spawn_sandboxes("py")[0]["id"]
    ctl.write_file(sid, "/tmp/a b&c.txt", "héllo")
    req = daemon.last
    assert req.method == "PUT"
    assert req.url.path == f"/v1/sandboxes/{sid}/files"
    assert req.url.params["path"] == "/tmp/a b&c.txt"
    assert b"%26" in req.url.raw_path  # & is encoded in the query
    assert req.content == "héllo".encode()
    assert req.headers["content-type"] == "application/octet-stream"
    ctl.write_file(sid, "/tmp/bin", b"\x00\xff")
    assert ctl.read_file(sid, "/tmp/bin") == b"\x00\xff"
    names = sorted(e["name"] for e in ctl.list_files(sid, "/tmp"))
    assert names == ["a b&c.txt", "bin"]
    assert daemon.last.url.path == f"/v1/sandboxes/{sid}/files/list"
    ctl.remove_file(sid, "/tmp/bin")
    assert daemon.last.method == "DELETE"
    assert dict(daemon.last.url.params) == {"path": "/tmp/bin", "recursive": "false"}
    ctl.remove_file(sid, "/tmp", recursive=True)
    assert daemon.last.url.params["recursive"] == "true"


def test_list_files_accepts_wrapped_entries() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"entries": [{"name": "x"}]})

    c = Controller("http://x", transport=httpx.MockTransport(handler))
    assert c.list_files("sb-1", "/") == [{"name": "x"}]


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


def test_unix_socket_transport(tmp_path: Path) -> None:
    seen: list[tuple[str, str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers["Host"], self.headers.get("Authorization")))
            data = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    sock = str(tmp_path / "forkd.sock")
    server = socketserver.UnixStreamServer(sock, Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        for url in (f"unix:{sock}", f"unix://{sock}"):
            with Controller(url, token="tk", timeout=5) as c:
                assert c.base_url == "http://forkd"
                assert c.health() == {"ok": True}
        assert c.socket_path == sock
        assert seen == [("/healthz", "forkd", "Bearer tk")] * 2
    finally:
        server.shutdown()
        server.server_close()


# -- Sandbox / Snapshot -------------------------------------------------------------


def test_sandbox_spawn_and_commands(daemon: FakeDaemon, ctl: Controller) -> None:
    sb = Sandbox("py", controller=ctl, memory_limit_mib=64)
    assert daemon.body() == {"snapshot_tag": "py", "n": 1, "memory_limit_mib": 64}
    assert sb.id in daemon.sandboxes and sb.info["snapshot_tag"] == "py"
    assert sb.controller is ctl

    r = sb.commands.run("exit 3", timeout=7)
    assert daemon.body() == {"args": ["/bin/sh", "-c", "exit 3"], "timeout_secs": 7}
    assert r == CommandResult(stdout="", stderr="bye\n", exit_code=3)
    assert not r.ok
    assert not r.timed_out
    r = sb.commands.run(["/bin/sh", "-c", "exit 124"])
    assert r.exit_code == 124 and r.timed_out
    r = sb.commands.run(["echo", "a", "b"], cwd="/", env={"X": "y"})
    assert r.stdout == "a b\n" and r.exit_code == 0 and r.ok
    assert daemon.body()["args"] == ["echo", "a", "b"]
    assert daemon.body()["cwd"] == "/" and daemon.body()["env"] == {"X": "y"}

    ev = sb.eval("6*7")
    assert isinstance(ev, EvalResult) and (ev.result, ev.error, ev.exit_code) == ("42", None, 0)
    assert ev.ok
    ev = sb.eval("1/0")
    assert ev.result is None and "ZeroDivisionError" in (ev.error or "") and not ev.ok
    daemon.eval_answer = {
        "result": None,
        "error": None,
        "exit_code": 0,
        "stdout": "hi\n",
        "stderr": "",
    }
    assert sb.eval("print('hi')").stdout == "hi\n"

    sb.files.write("/tmp/t.txt", "text")
    assert sb.files.read("/tmp/t.txt") == b"text"
    assert sb.files.read_text("/tmp/t.txt") == "text"
    assert [e["name"] for e in sb.files.list("/tmp")] == ["t.txt"]
    sb.files.remove("/tmp/t.txt")
    assert "/tmp/t.txt" not in {p for _, p in daemon.files}
    assert sb.ping()["pong"] is True
    assert sb.refresh()["state"] == "running"


def test_sandbox_context_manager_kills_once(daemon: FakeDaemon, ctl: Controller) -> None:
    with Sandbox.create("py", controller=ctl) as sb:
        sid = sb.id
        assert sid in daemon.sandboxes
    assert sid not in daemon.sandboxes and sb.killed
    deletes = [r for r in daemon.requests if r.method == "DELETE"]
    assert len(deletes) == 1
    sb.kill()  # idempotent: no second request
    assert len([r for r in daemon.requests if r.method == "DELETE"]) == 1

    # killing one that is already gone on the daemon is fine too
    other = Sandbox("py", controller=ctl)
    del daemon.sandboxes[other.id]
    other.kill()
    assert other.killed


def test_sandbox_context_manager_kills_on_error(daemon: FakeDaemon, ctl: Controller) -> None:
    with pytest.raises(RuntimeError), Sandbox("py", controller=ctl) as sb:
        raise RuntimeError("boom")
    assert sb.id not in daemon.sandboxes


def test_sandbox_attach_and_errors(daemon: FakeDaemon, ctl: Controller) -> None:
    sid = daemon.add_sandbox("py")["id"]
    sb = Sandbox(sandbox_id=sid, controller=ctl)
    assert sb.id == sid and sb.info["pid"] == daemon.sandboxes[sid]["pid"]
    assert daemon.last.method == "GET"
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


def test_snapshot_fork_and_branch(daemon: FakeDaemon, ctl: Controller) -> None:
    snap = Snapshot.create("tpl", controller=ctl, memory_mib=256, warmup="import json")
    assert daemon.body() == {"tag": "tpl", "memory_mib": 256, "warmup": "import json"}
    assert snap.tag == "tpl" and snap.info["memory_mib"] == 256
    assert snap.branched_from is None and snap.pause_ms is None

    kids = snap.fork(3, timeout_secs=60)
    assert daemon.body() == {"snapshot_tag": "tpl", "n": 3, "timeout_secs": 60}
    assert all(isinstance(k, Sandbox) for k in kids)
    assert [k.id for k in kids] == [s["id"] for s in daemon.sandboxes.values()]
    assert len({k.id for k in kids}) == 3
    assert all(k.controller is ctl for k in kids)

    branch = kids[0].branch()
    assert isinstance(branch, Snapshot)
    assert branch.tag == f"branch-{kids[0].id}-1"
    assert branch.branched_from == kids[0].id and branch.pause_ms == 212
    named = kids[1].branch(tag="b2")
    assert named.tag == "b2" and daemon.body() == {"tag": "b2"}

    grandkids = branch.fork(2)
    assert {g.info["snapshot_tag"] for g in grandkids} == {branch.tag}
    assert branch.refresh()["parent_tag"] == "tpl"
    branch.delete()
    assert branch.tag not in daemon.snapshots


def test_snapshot_info_is_lazy(daemon: FakeDaemon, ctl: Controller) -> None:
    daemon.add_snapshot("b", branched_from="sb-x", pause_ms=99)
    snap = Snapshot("b", controller=ctl)
    n = len(daemon.requests)
    assert snap.pause_ms == 99 and snap.branched_from == "sb-x"
    assert len(daemon.requests) == n + 1
    assert daemon.last.url.path == "/v1/snapshots/b/info"
    assert snap.pause_ms == 99
    assert len(daemon.requests) == n + 1


# -- CLI ----------------------------------------------------------------------------

runner = CliRunner()


def make_app(daemon: FakeDaemon | None) -> typer.Typer:
    app = typer.Typer()

    @app.command("version")  # as in forkd.cli: more than one command keeps subcommands
    def version() -> None:
        pass

    cli.add_daemon_commands(app, transport=daemon.transport if daemon else None)
    return app


def invoke(daemon: FakeDaemon | None, *args: str) -> Any:
    return runner.invoke(make_app(daemon), list(args))


def test_cli_exec_passes_exit_code(daemon: FakeDaemon) -> None:
    sid = daemon.add_sandbox("py")["id"]
    res = invoke(daemon, "exec", sid, "--", "echo", "hello", "-n")
    assert res.exit_code == 0, res.output
    assert res.stdout == "hello -n\n"
    assert daemon.body() == {"args": ["echo", "hello", "-n"], "timeout_secs": 30.0}

    res = invoke(daemon, "exec", "--timeout", "5", sid, "--", "/bin/sh", "-c", "exit 7")
    assert res.exit_code == 7
    assert res.stderr == "bye\n"
    assert daemon.body()["timeout_secs"] == 5.0

    res = invoke(daemon, "exec", sid, "--json", "--", "/bin/sh", "-c", "exit 3")
    assert res.exit_code == 3
    assert json.loads(res.stdout)["exit_code"] == 3


def test_exit_code_of() -> None:
    from forkd.client import exit_code_of

    assert exit_code_of({"exit_code": 3}) == 3
    assert exit_code_of({"exit_code": None, "timed_out": True}) == 124
    assert exit_code_of({"exit_code": None}) == -1


def test_cli_eval(daemon: FakeDaemon) -> None:
    sid = daemon.add_sandbox("py")["id"]
    res = invoke(daemon, "eval", sid, "40+2")
    assert res.exit_code == 0 and res.stdout == "42\n"
    res = invoke(daemon, "eval", sid, "1/0")
    assert res.exit_code == 1
    assert "ZeroDivisionError" in res.stderr and res.stdout == ""


def test_cli_error_404_and_unreachable(daemon: FakeDaemon) -> None:
    res = invoke(daemon, "exec", "sb-nope", "--", "true")
    assert res.exit_code == 1
    assert "error:" in res.stderr and "unknown sandbox sb-nope" in res.stderr
    res = invoke(daemon, "snapshot", "info", "nope")
    assert res.exit_code == 1 and "unknown snapshot nope" in res.stderr

    url = f"http://127.0.0.1:{free_port()}"
    res = invoke(None, "ps", "--url", url)
    assert res.exit_code == 2
    assert "not reachable" in res.stderr and "forkd serve" in res.stderr


def test_cli_token_file(daemon: FakeDaemon, tmp_path: Path) -> None:
    daemon.token = "tk"
    res = invoke(daemon, "ps")
    assert res.exit_code == 1 and "bearer token" in res.stderr
    tf = tmp_path / "tok"
    tf.write_text("tk\n")
    res = invoke(daemon, "ps", "--token-file", str(tf), "--json")
    assert res.exit_code == 0, res.output
    assert daemon.last.headers["authorization"] == "Bearer tk"
    res = invoke(daemon, "ps", "--token-file", str(tmp_path / "missing"))
    assert res.exit_code == 2 and "token file" in res.stderr


def test_cli_json_outputs_parse(daemon: FakeDaemon) -> None:
    res = invoke(daemon, "fork", "--tag", "py", "-n", "3", "--memory-limit", "128", "--json")
    assert res.exit_code == 0, res.output
    kids = json.loads(res.stdout)
    assert len(kids) == 3 and all(k["snapshot_tag"] == "py" for k in kids)
    assert daemon.body() == {"snapshot_tag": "py", "n": 3, "memory_limit_mib": 128}

    ps = json.loads(invoke(daemon, "ps", "--json").stdout)
    assert {s["id"] for s in ps} == {k["id"] for k in kids}
    snaps = json.loads(invoke(daemon, "snapshot", "ls", "--json").stdout)
    assert [s["tag"] for s in snaps] == ["py"]
    info = json.loads(invoke(daemon, "snapshot", "info", "py", "--json").stdout)
    assert info["tag"] == "py"

    res = invoke(daemon, "snapshot", "--from-sandbox", kids[0]["id"], "--tag", "b1", "--json")
    assert res.exit_code == 0, res.output
    b = json.loads(res.stdout)
    assert b["tag"] == "b1" and b["branched_from"] == kids[0]["id"] and b["pause_ms"] == 212

    res = invoke(daemon, "branch", "--from-sandbox", kids[1]["id"], "-n", "2", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["branch"]["branched_from"] == kids[1]["id"]
    assert [s["snapshot_tag"] for s in out["sandboxes"]] == [out["branch"]["tag"]] * 2

    forest = json.loads(invoke(daemon, "tree", "--json").stdout)
    assert [n["tag"] for n in forest] == ["py"]
    sb_nodes = {c["id"]: c for c in forest[0]["children"] if c["kind"] == "sandbox"}
    assert set(sb_nodes) == {k["id"] for k in kids}
    b1 = sb_nodes[kids[0]["id"]]["children"]
    assert [(c["kind"], c["tag"]) for c in b1] == [("snapshot", "b1")]
    branch2 = sb_nodes[kids[1]["id"]]["children"][0]
    assert len(branch2["children"]) == 2

    res = invoke(daemon, "rm", kids[0]["id"], "sb-nope", "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout)["removed"] == [kids[0]["id"]]


def test_cli_human_output(daemon: FakeDaemon) -> None:
    res = invoke(daemon, "snapshot", "create", "--tag", "np", "--memory", "256", "--setup", "a")
    assert res.exit_code == 0, res.output
    assert daemon.body() == {"tag": "np", "memory_mib": 256, "setup": ["a"]}
    assert "np" in res.stdout

    res = invoke(daemon, "fork", "--tag", "np", "-n", "2")
    assert res.exit_code == 0, res.output
    ids = [s["id"] for s in daemon.sandboxes.values()]
    assert all(i in res.stdout for i in ids)

    res = invoke(daemon, "snapshot", "--from-sandbox", ids[0], "--tag", "b1")
    assert res.exit_code == 0, res.output
    assert "b1" in res.stdout and "212 ms" in res.stdout

    res = invoke(daemon, "branch", "--from-sandbox", ids[1], "-n", "1")
    assert res.exit_code == 0, res.output
    assert ids[1] in res.stdout and "212 ms" in res.stdout and "sb-67a1b3-0003" in res.stdout

    res = invoke(daemon, "ps")
    assert res.exit_code == 0 and all(i in res.stdout for i in ids)
    res = invoke(daemon, "snapshot", "ls")
    assert res.exit_code == 0 and "b1" in res.stdout and "np" in res.stdout
    for cmd in (("tree",), ("snapshot", "ls", "--tree")):
        res = invoke(daemon, *cmd)
        assert res.exit_code == 0, res.output
        assert "b1" in res.stdout and ids[0] in res.stdout and "np" in res.stdout

    res = invoke(daemon, "rmi", "b1", "nope")
    assert res.exit_code == 1
    assert "deleted b1" in res.stdout and "unknown snapshot nope" in res.stderr
    res = invoke(daemon, "rm", *daemon.sandboxes)
    assert res.exit_code == 0 and not daemon.sandboxes

    res = invoke(daemon, "snapshot")  # no subcommand, no --from-sandbox: help
    assert res.exit_code == 0 and "create" in res.stdout


def test_lineage_forest_dead_source() -> None:
    snaps = [
        {"tag": "py"},
        {"tag": "b", "branched_from": "sb-gone", "parent_tag": "py"},
        {"tag": "orphan", "branched_from": "sb-gone2"},
    ]
    sbs = [{"id": "sb-2", "snapshot_tag": "b"}, {"id": "sb-3", "snapshot_tag": "deleted"}]
    forest = render.lineage_forest(snaps, sbs)
    flat = render.strip_forest(forest)
    assert [(n["kind"], n.get("tag")) for n in flat] == [
        ("snapshot", "py"),
        ("snapshot", "orphan"),
        ("missing", "deleted"),
    ]
    b = flat[0]["children"][0]
    assert b["tag"] == "b" and b["children"][0]["id"] == "sb-2"
    assert flat[2]["children"][0]["id"] == "sb-3"
