"""Background processes: start, stdin, signals, a terminal's size, the output stream's events."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from forkd import limits
from forkd.controller.models.common import StreamError, StrictBody
from forkd.controller.models.images import ImageInfo, ImportProgress


class PtySize(StrictBody):
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


Argv = Annotated[list[str], Field(min_length=1, max_length=4096)]


ShellLine = Annotated[str, Field(min_length=1, description="runs as /bin/sh -c")]


class ProcessStart(StrictBody):
    cmd: Argv | ShellLine
    env: dict[str, str] | None = None
    cwd: str | None = None
    stdin: bool = Field(False, description="keep stdin open for POST .../stdin; else /dev/null")
    pty: PtySize | None = Field(None, description="run in a terminal of this size")
    timeout_s: float | None = Field(
        None, gt=0, le=limits.MAX_EXEC_TIMEOUT_SECS, description="then SIGKILL, exit code 124"
    )
    user: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="run as this user: name, uid, name:group or uid:gid (Docker's USER forms); "
        "default the image's USER, else root",
    )


class ProcessStdin(StrictBody):
    data: str = Field("", max_length=limits.JSON_BODY_LIMIT)
    encoding: Literal["utf-8", "base64"] = "utf-8"
    eof: bool = Field(False, description="close stdin after data (a terminal gets ^D)")


SignalNumber = Annotated[int, Field(ge=1, le=64)]


SignalName = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9+]{0,15}$")]


class ProcessSignal(StrictBody):
    signal: SignalNumber | SignalName = Field(
        "SIGTERM", description="a number (1-64) or a name: 'SIGKILL' or 'KILL'"
    )


class ProcessResize(StrictBody):
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


class ProcessInfo(BaseModel):
    pid: int
    cmd: list[str]
    pty: bool
    stdin: bool
    running: bool
    exit_code: int | None = Field(description="128+N when killed by signal N; 124: timeout_s")
    started_at: float = Field(description="guest unix time")
    ended_at: float | None
    output_start: int = Field(description="oldest output offset still held (4 MiB ring)")
    output_end: int = Field(description="offset after the last byte of output")


class StdinWritten(BaseModel):
    written: int


class OutputData(BaseModel):
    """A ``stdout``, ``stderr`` or ``pty`` event of an output stream."""

    data: str
    encoding: Literal["utf-8", "base64"] = Field(description="base64 when not valid UTF-8")
    offset: int = Field(description="of the first byte")
    next_offset: int = Field(description="after the last byte: where to resume")

    def raw(self) -> bytes:
        """The bytes this event carries, whichever way they were encoded."""
        return self.data.encode() if self.encoding == "utf-8" else base64.b64decode(self.data)


class OutputGap(BaseModel):
    """A ``gap`` event: output from ``from`` to ``to`` left the ring before it was read."""

    model_config = ConfigDict(populate_by_name=True)
    from_offset: int = Field(alias="from")
    to: int


class OutputExit(BaseModel):
    """The last event, ``exit``: the process ended and all its output was sent."""

    exit_code: int | None


@dataclass(frozen=True)
class OutputEvent:
    """One event of an output stream; no ``body`` is a keep-alive while nothing happens.
    An image import's stream has ``progress`` events, then ``image`` (or ``error``)."""

    event: Literal[
        "stdout", "stderr", "pty", "gap", "exit", "error", "keepalive", "progress", "image"
    ]
    body: OutputData | OutputGap | OutputExit | StreamError | ImportProgress | ImageInfo | None = (
        None
    )
    next_offset: int | None = None
