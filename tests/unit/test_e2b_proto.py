"""forkd's own definitions of envd's messages (forkd.controller.e2b.*_messages) are the
wire format E2B's SDK speaks: every message, field, number, type, JSON name, oneof and
enum value equals the descriptors E2B's published SDK carries, and a message encoded by
one side decodes to the same message on the other, in binary and in JSON."""

from __future__ import annotations

from typing import Any

import pytest
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb
from protobuf import DescFile, Oneof
from protobuf.wkt.google.protobuf.descriptor_pb import DescriptorProto, FileDescriptorProto

from forkd.controller.e2b import filesystem_messages as fs
from forkd.controller.e2b import process_messages as proc

PAIRS = [(proc.DESC, process_pb.desc()), (fs.DESC, filesystem_pb.desc())]


def _fields(msg: DescriptorProto, scope: str) -> dict[str, Any]:
    """What of a message the wire sees, by full name, nested messages included."""
    here = f"{scope}.{msg.name}"
    oneofs = [o.name for o in msg.oneof_decl]
    found: dict[str, Any] = {
        here: sorted(
            (
                f.number,
                f.name,
                f.json_name,
                int(f.type),
                int(f.label),
                f.type_name,
                bool(f.proto3_optional),
                oneofs[f.oneof_index] if f.has_field("oneof_index") else None,
            )
            for f in msg.field
        )
    }
    if msg.options is not None and msg.options.map_entry:
        found[here].append("map entry")
    for nested in msg.nested_type:
        found |= _fields(nested, here)
    return found


def _wire(desc: DescFile) -> dict[str, Any]:
    proto: FileDescriptorProto = desc.proto
    found: dict[str, Any] = {"file": (proto.name, proto.package, list(proto.dependency))}
    for msg in proto.message_type:
        found |= _fields(msg, f".{proto.package}")
    for enum in proto.enum_type:
        found[f"enum {enum.name}"] = sorted((v.name, v.number) for v in enum.value)
    return found


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=["process", "filesystem"])
def test_every_message_is_the_one_e2bs_sdk_speaks(ours: DescFile, theirs: DescFile) -> None:
    assert _wire(ours) == _wire(theirs)


def test_a_start_request_and_its_events_cross_both_ways() -> None:
    sent = process_pb.StartRequest(
        process=process_pb.ProcessConfig(
            cmd="/bin/bash", args=["-l", "-c", "echo hi"], envs={"A": "1"}, cwd="/tmp"
        ),
        pty=process_pb.PTY(size=process_pb.PTY.Size(cols=80, rows=24)),
        tag="job",
        stdin=True,
    )
    got = proc.StartRequest.from_binary(sent.to_binary())
    assert got.process is not None and got.process.args == ["-l", "-c", "echo hi"]
    assert got.process.envs == {"A": "1"} and got.has_field("stdin") and got.stdin
    assert got.pty is not None and got.pty.size is not None and got.pty.size.rows == 24
    assert got.to_json() == sent.to_json()

    end = proc.EndEvent(exit_code=-9, exited=False, status="signal: killed", error="killed")
    event = proc.StartResponse(event=proc.ProcessEvent(event=Oneof("end", end)))
    back = process_pb.StartResponse.from_json(event.to_json())
    assert back.to_binary() == event.to_binary()
    assert back.event is not None and back.event.event == Oneof(
        "end",
        process_pb.ProcessEvent.EndEvent(
            exit_code=-9, exited=False, status="signal: killed", error="killed"
        ),
    )


def test_a_signal_and_an_absent_optional_read_as_sent() -> None:
    sig = proc.SendSignalRequest.from_json('{"process":{"tag":"job"},"signal":"SIGNAL_SIGKILL"}')
    assert sig.signal == proc.Signal.SIGKILL
    assert sig.process is not None and sig.process.selector == Oneof("tag", "job")
    bare = proc.StartRequest.from_json('{"process":{"cmd":"ls"}}')
    assert not bare.has_field("stdin") and not bare.has_field("pty")


def test_an_entry_crosses_with_its_size_as_a_string_and_its_time() -> None:
    from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

    entry = fs.EntryInfo(
        name="a.txt",
        type=fs.FileType.FILE,
        path="/home/user/a.txt",
        size=3,
        mode=0o644,
        permissions="-rw-r--r--",
        modified_time=Timestamp(seconds=1_700_000_000),
    )
    answer = fs.ListDirResponse(entries=[entry])
    assert '"size":"3"' in answer.to_json() and "2023-11-14T22:13:20Z" in answer.to_json()
    theirs = filesystem_pb.ListDirResponse.from_binary(answer.to_binary())
    assert theirs.entries[0].type == filesystem_pb.FileType.FILE
    assert theirs.to_json() == answer.to_json()


def test_what_the_port_keeps_per_sandbox_forgets_sandboxes_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from forkd.controller.e2b import per_sandbox

    monkeypatch.setattr(per_sandbox, "MAX_HELD", 3)
    alive = {"a", "c"}
    held: per_sandbox.PerSandbox[dict[str, int]] = per_sandbox.PerSandbox(dict, alive.__contains__)
    for sid in ("a", "b", "c"):
        held.of(sid)["tag"] = 1
    held.of("d")  # a fourth: the gone one ("b") is forgotten
    assert held.get("b") is None and held.get("a") == {"tag": 1} and held.get("d") == {}


def test_what_the_port_keeps_per_sandbox_is_bounded_even_when_all_are_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from forkd.controller.e2b import per_sandbox

    monkeypatch.setattr(per_sandbox, "MAX_HELD", 2)
    held: per_sandbox.PerSandbox[list[int]] = per_sandbox.PerSandbox(list, lambda _sid: True)
    for sid in ("a", "b", "c"):
        held.of(sid)
    assert held.get("a") is None and held.get("b") == [] and held.get("c") == []


def test_a_rich_json_output_the_sdks_cannot_read_back_is_left_out() -> None:
    from forkd.controller.e2b.interpreter_python import _result

    assert _result("application/json", '{"a": [1, 2]}') == {
        "type": "result",
        "json": {"a": [1, 2]},
        "is_main_result": False,
    }
    assert _result("application/json", '{"a": NaN}') is None
    assert _result("application/json", "[" * 100_000 + "]" * 100_000) is None
    assert _result("application/x-unknown", "x") is None
