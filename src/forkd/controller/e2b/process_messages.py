"""The messages of envd's ``process.Process`` service, as E2B's SDKs encode them
(package ``process``, file ``process/process.proto``): forkd's own definitions of that
wire format (:mod:`.proto_schema`), field for field the same numbers, types and names.

A command is started with its config and, optionally, a terminal and a tag; its events
stream back (``start`` with its pid first, then output, then ``end``); later calls
name it by pid or tag (:class:`ProcessSelector`).
"""

from __future__ import annotations

from typing import Literal

from protobuf import DescFile, Enum, Message, Oneof

from forkd.controller.e2b.proto_schema import EnumDef, Field, Msg, ProtoFile, build


class PtySize(Message):
    __slots__ = ("cols", "rows")
    cols: int
    rows: int


class Pty(Message):
    __slots__ = ("size",)
    size: PtySize | None


class ProcessConfig(Message):
    __slots__ = ("args", "cmd", "cwd", "envs")
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str


class ProcessInfo(Message):
    __slots__ = ("config", "pid", "tag")
    config: ProcessConfig | None
    pid: int
    tag: str


class ListRequest(Message):
    __slots__ = ()


class ListResponse(Message):
    __slots__ = ("processes",)
    processes: list[ProcessInfo]


class StartRequest(Message):
    __slots__ = ("process", "pty", "stdin", "tag")
    process: ProcessConfig | None
    pty: Pty | None
    tag: str
    stdin: bool


class ProcessSelector(Message):
    __slots__ = ("selector",)
    selector: Oneof[Literal["pid"], int] | Oneof[Literal["tag"], str] | None


class UpdateRequest(Message):
    __slots__ = ("process", "pty")
    process: ProcessSelector | None
    pty: Pty | None


class UpdateResponse(Message):
    __slots__ = ()


class StartEvent(Message):
    __slots__ = ("pid",)
    pid: int


Output = Oneof[Literal["stdout", "stderr", "pty"], bytes]


class DataEvent(Message):
    __slots__ = ("output",)
    output: Output | None


class EndEvent(Message):
    __slots__ = ("error", "exit_code", "exited", "status")
    exit_code: int
    exited: bool
    status: str
    error: str


class KeepAlive(Message):
    __slots__ = ()


class ProcessEvent(Message):
    __slots__ = ("event",)
    event: (
        Oneof[Literal["start"], StartEvent]
        | Oneof[Literal["data"], DataEvent]
        | Oneof[Literal["end"], EndEvent]
        | Oneof[Literal["keepalive"], KeepAlive]
        | None
    )


class StartResponse(Message):
    __slots__ = ("event",)
    event: ProcessEvent | None


class ConnectResponse(Message):
    __slots__ = ("event",)
    event: ProcessEvent | None


class ProcessInput(Message):
    __slots__ = ("input",)
    input: Oneof[Literal["stdin", "pty"], bytes] | None


class SendInputRequest(Message):
    __slots__ = ("input", "process")
    process: ProcessSelector | None
    input: ProcessInput | None


class SendInputResponse(Message):
    __slots__ = ()


class InputStart(Message):
    __slots__ = ("process",)
    process: ProcessSelector | None


class InputData(Message):
    __slots__ = ("input",)
    input: ProcessInput | None


class InputKeepAlive(Message):
    __slots__ = ()


class StreamInputRequest(Message):
    __slots__ = ("event",)
    event: (
        Oneof[Literal["start"], InputStart]
        | Oneof[Literal["data"], InputData]
        | Oneof[Literal["keepalive"], InputKeepAlive]
        | None
    )


class StreamInputResponse(Message):
    __slots__ = ()


class Signal(Enum):
    UNSPECIFIED = 0
    SIGTERM = 15
    SIGKILL = 9


class SendSignalRequest(Message):
    __slots__ = ("process", "signal")
    process: ProcessSelector | None
    signal: Signal


class SendSignalResponse(Message):
    __slots__ = ()


class CloseStdinRequest(Message):
    __slots__ = ("process",)
    process: ProcessSelector | None


class CloseStdinResponse(Message):
    __slots__ = ()


class ConnectRequest(Message):
    __slots__ = ("process",)
    process: ProcessSelector | None


_SELECTOR = Field("process", 1, ".process.ProcessSelector")
_EVENT = (Field("event", 1, ".process.ProcessEvent"),)

FILE = ProtoFile(
    path="process/process.proto",
    package="process",
    messages=(
        Msg(
            "PTY",
            Pty,
            (Field("size", 1, ".process.PTY.Size"),),
            nested=(
                Msg("Size", PtySize, (Field("cols", 1, "uint32"), Field("rows", 2, "uint32"))),
            ),
        ),
        Msg(
            "ProcessConfig",
            ProcessConfig,
            (
                Field("cmd", 1, "string"),
                Field("args", 2, "string", repeated=True),
                Field("envs", 3, "", map_value="string"),
                Field("cwd", 4, "string", optional=True),
            ),
        ),
        Msg("ListRequest", ListRequest),
        Msg(
            "ProcessInfo",
            ProcessInfo,
            (
                Field("config", 1, ".process.ProcessConfig"),
                Field("pid", 2, "uint32"),
                Field("tag", 3, "string", optional=True),
            ),
        ),
        Msg(
            "ListResponse",
            ListResponse,
            (Field("processes", 1, ".process.ProcessInfo", repeated=True),),
        ),
        Msg(
            "StartRequest",
            StartRequest,
            (
                Field("process", 1, ".process.ProcessConfig"),
                Field("pty", 2, ".process.PTY", optional=True),
                Field("tag", 3, "string", optional=True),
                Field("stdin", 4, "bool", optional=True),
            ),
        ),
        Msg(
            "UpdateRequest",
            UpdateRequest,
            (_SELECTOR, Field("pty", 2, ".process.PTY", optional=True)),
        ),
        Msg("UpdateResponse", UpdateResponse),
        Msg(
            "ProcessEvent",
            ProcessEvent,
            (
                Field("start", 1, ".process.ProcessEvent.StartEvent", oneof="event"),
                Field("data", 2, ".process.ProcessEvent.DataEvent", oneof="event"),
                Field("end", 3, ".process.ProcessEvent.EndEvent", oneof="event"),
                Field("keepalive", 4, ".process.ProcessEvent.KeepAlive", oneof="event"),
            ),
            nested=(
                Msg("StartEvent", StartEvent, (Field("pid", 1, "uint32"),)),
                Msg(
                    "DataEvent",
                    DataEvent,
                    (
                        Field("stdout", 1, "bytes", oneof="output"),
                        Field("stderr", 2, "bytes", oneof="output"),
                        Field("pty", 3, "bytes", oneof="output"),
                    ),
                ),
                Msg(
                    "EndEvent",
                    EndEvent,
                    (
                        Field("exit_code", 1, "sint32"),
                        Field("exited", 2, "bool"),
                        Field("status", 3, "string"),
                        Field("error", 4, "string", optional=True),
                    ),
                ),
                Msg("KeepAlive", KeepAlive),
            ),
        ),
        Msg("StartResponse", StartResponse, _EVENT),
        Msg("ConnectResponse", ConnectResponse, _EVENT),
        Msg(
            "SendInputRequest",
            SendInputRequest,
            (_SELECTOR, Field("input", 2, ".process.ProcessInput")),
        ),
        Msg("SendInputResponse", SendInputResponse),
        Msg(
            "ProcessInput",
            ProcessInput,
            (
                Field("stdin", 1, "bytes", oneof="input"),
                Field("pty", 2, "bytes", oneof="input"),
            ),
        ),
        Msg(
            "StreamInputRequest",
            StreamInputRequest,
            (
                Field("start", 1, ".process.StreamInputRequest.StartEvent", oneof="event"),
                Field("data", 2, ".process.StreamInputRequest.DataEvent", oneof="event"),
                Field("keepalive", 3, ".process.StreamInputRequest.KeepAlive", oneof="event"),
            ),
            nested=(
                Msg("StartEvent", InputStart, (_SELECTOR,)),
                Msg("DataEvent", InputData, (Field("input", 2, ".process.ProcessInput"),)),
                Msg("KeepAlive", InputKeepAlive),
            ),
        ),
        Msg("StreamInputResponse", StreamInputResponse),
        Msg(
            "SendSignalRequest",
            SendSignalRequest,
            (_SELECTOR, Field("signal", 2, ".process.Signal")),
        ),
        Msg("SendSignalResponse", SendSignalResponse),
        Msg("CloseStdinRequest", CloseStdinRequest, (_SELECTOR,)),
        Msg("CloseStdinResponse", CloseStdinResponse),
        Msg("ConnectRequest", ConnectRequest, (_SELECTOR,)),
        Msg(
            "ProcessSelector",
            ProcessSelector,
            (
                Field("pid", 1, "uint32", oneof="selector"),
                Field("tag", 2, "string", oneof="selector"),
            ),
        ),
    ),
    enums=(
        EnumDef(
            "Signal",
            Signal,
            (("SIGNAL_UNSPECIFIED", 0), ("SIGNAL_SIGTERM", 15), ("SIGNAL_SIGKILL", 9)),
        ),
    ),
)

DESC: DescFile = build(FILE)
