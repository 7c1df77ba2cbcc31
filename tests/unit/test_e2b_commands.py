"""E2B's ``commands`` API (envd's process.Process over Connect) through E2B's own SDK,
against forkd's E2B port with fake VMs: a command's output and exit, background
commands with stdin, connect, list and kill, and the Connect wire itself (binary
protobuf, errors, the access token). The fake guest plays ``/bin/bash -l -c LINE`` as
LINE's script (tests/unit/fake_processes.py)."""

from __future__ import annotations

import json
from typing import Any

import e2b
import httpx
import pytest
from e2b.envd.process import process_pb

from tests.unit.conftest import Server
from tests.unit.e2b_port import forkd_client


def test_a_command_runs_in_the_sandbox_and_its_output_and_exit_come_back(
    server: Server, e2b_url: str
) -> None:
    sbx = e2b.Sandbox.create("base")
    result = sbx.commands.run("echo hello from e2b")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "hello from e2b\n", "")
    seen: list[str] = []
    sbx.commands.run("count 3 0.01", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"
    with pytest.raises(e2b.CommandExitException) as failed:
        sbx.commands.run("exit 3")
    assert failed.value.exit_code == 3 and failed.value.stderr == "exit 3\n"
    with forkd_client(server) as c:  # the daemon's own process list has them
        cmds = [p["cmd"] for p in c.get(f"/v1/sandboxes/{sbx.sandbox_id}/processes").json()]
    assert ["/bin/bash", "-l", "-c", "echo hello from e2b"] in cmds
    sbx.kill()


def test_a_background_command_takes_stdin_and_is_listed_connected_and_killed(
    e2b_url: str,
) -> None:
    sbx = e2b.Sandbox.create("base")
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "typed ")
    sbx.commands.send_stdin(cat.pid, "in")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "typed in"

    server = sbx.commands.run("serve 8080", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert server.pid in listed and cat.pid not in listed  # ended: forgotten, as envd does
    assert listed[server.pid].cmd == "/bin/bash"
    assert listed[server.pid].args == ["-l", "-c", "serve 8080"]
    again = sbx.commands.connect(server.pid)
    assert again.pid == server.pid
    assert sbx.commands.kill(server.pid) is True
    assert sbx.commands.kill(server.pid) is False  # not running: envd's not_found
    with pytest.raises(e2b.CommandExitException) as killed:  # the connected stream ends too
        again.wait()
    assert killed.value.exit_code == 128 + 9
    sbx.kill()


def test_a_command_runs_as_the_user_the_sdk_names(e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    sbx.kill()


def _rpc(
    url: str,
    sbx: e2b.Sandbox,
    method: str,
    headers: dict[str, str] | None = None,
    **kw: Any,
) -> httpx.Response:
    """A Connect call of ``method`` by hand, with the sandbox's headers (and ``headers``)."""
    sent = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""}
    return httpx.post(f"{url}/process.Process/{method}", headers=sent | (headers or {}), **kw)


def test_the_connect_wire_answers_binary_protobuf_and_its_own_errors(e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    running = sbx.commands.run("serve 9000", background=True)
    binary = _rpc(
        e2b_url,
        sbx,
        "List",
        content=process_pb.ListRequest().to_binary(),
        headers={"Content-Type": "application/proto"},
    )
    assert binary.status_code == 200 and binary.headers["content-type"] == "application/proto"
    listed = process_pb.ListResponse.from_binary(binary.content)
    assert [p.pid for p in listed.processes] == [running.pid]

    unknown = _rpc(e2b_url, sbx, "SendSignal", json={"process": {"pid": 99999}, "signal": 9})
    assert unknown.status_code == 404 and unknown.json()["code"] == "not_found"
    untagged = _rpc(
        e2b_url,
        sbx,
        "Connect",
        content=_envelope(b'{"process": {"tag": "nope"}}'),
        headers={"Content-Type": "application/connect+json"},
    )
    assert untagged.status_code == 200  # a stream: its error is in its end
    assert untagged.content.startswith(b"\x02") and b'"not_found"' in untagged.content
    as_json = _rpc(e2b_url, sbx, "Connect", json={"process": {"pid": running.pid}})
    assert as_json.status_code == 415  # a stream is enveloped: connect+json or +proto
    wrong = _rpc(e2b_url, sbx, "List", json={}, headers={"X-Access-Token": "not-it"})
    assert wrong.json()["code"] == "unavailable" and "was not found" in wrong.json()["message"]
    none = httpx.post(
        f"{e2b_url}/process.Process/List", json={}, headers={"E2b-Sandbox-Id": sbx.sandbox_id}
    )
    assert none.status_code == 401 and none.json()["code"] == "unauthenticated"
    assert running.kill()
    sbx.kill()
    gone = _rpc(e2b_url, sbx, "List", json={})
    assert gone.json()["code"] == "unavailable" and "was not found" in gone.json()["message"]


def test_a_tagged_command_is_found_by_its_tag(e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    start = b'{"process":{"cmd":"serve","args":["7000"]},"tag":"web"}'
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Access-Token": sbx._envd_access_token or "",
        "Content-Type": "application/connect+json",
    }
    with httpx.stream(
        "POST", f"{e2b_url}/process.Process/Start", content=_envelope(start), headers=headers
    ) as stream:
        first = next(stream.iter_bytes())  # the start event; the command goes on
    pid = json.loads(first[5:])["event"]["start"]["pid"]
    [listed] = _rpc(e2b_url, sbx, "List", json={}).json()["processes"]
    assert (listed["pid"], listed["tag"]) == (pid, "web")
    killed = _rpc(
        e2b_url, sbx, "SendSignal", json={"process": {"tag": "web"}, "signal": "SIGNAL_SIGKILL"}
    )
    assert killed.status_code == 200
    assert _rpc(e2b_url, sbx, "List", json={}).json() == {}
    long_tag = b'{"process":{"cmd":"serve","args":["7001"]},"tag":"' + b"x" * 300 + b'"}'
    refused = _rpc(
        e2b_url,
        sbx,
        "Start",
        content=_envelope(long_tag),
        headers={"Content-Type": "application/connect+json"},
    )
    assert b"invalid_argument" in refused.content and b"a tag is 1 to 256" in refused.content
    sbx.kill()


def _envelope(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def test_stdin_streamed_in_one_client_stream_arrives_in_order(e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(cat.pid, ["one ", b"two ", "three"])  # StreamInput, client-side
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "one two three"
    with pytest.raises(e2b.NotFoundException):
        sbx.commands.stream_input(99999, ["x"])
    sbx.kill()
