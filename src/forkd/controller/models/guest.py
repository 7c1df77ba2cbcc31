"""A sandbox's guest: exec, eval, ping and whole files, and their answers."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from forkd import limits
from forkd.controller.models.common import StrictBody


class ExecRequest(StrictBody):
    args: list[str] = Field(min_length=1)
    timeout_secs: float = Field(limits.EXEC_TIMEOUT_SECS, gt=0, le=limits.MAX_EXEC_TIMEOUT_SECS)
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None
    user: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="run as this user: name, uid, name:group or uid:gid (Docker's USER forms); "
        "default the image's USER, else root",
    )


class EvalRequest(StrictBody):
    code: str
    timeout_s: float = Field(
        limits.EVAL_TIMEOUT_SECS,
        gt=0,
        le=limits.MAX_EVAL_TIMEOUT_SECS,
        description="then the eval is interrupted and answers with timed_out",
    )
    timeout: float | None = Field(
        None,
        gt=0,
        le=limits.MAX_EVAL_TIMEOUT_SECS,
        description="the original forkd agent's name of timeout_s (give one of them)",
    )

    @model_validator(mode="after")
    def _one_timeout(self) -> EvalRequest:
        if self.timeout is not None:
            if "timeout_s" in self.model_fields_set and self.timeout_s != self.timeout:
                raise ValueError("timeout and timeout_s differ: give one of them")
            self.timeout_s = self.timeout
        return self


class PingResult(BaseModel):
    """``pong`` and what the guest agent reports about itself."""

    model_config = ConfigDict(extra="allow")
    pong: bool


class ExecResult(BaseModel):
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_ms: float | None


class DisplayOutput(BaseModel):
    mime: str = Field(description="image/png, image/jpeg: base64; text/plain, text/html, ...")
    data: str


class EvalResult(BaseModel):
    result: str | None
    error: str | None = Field(
        description="a failure's one-line summary (NameError: name 'x' is not defined), as the "
        "original forkd answered; the whole text is in traceback"
    )
    traceback: str | None = Field(
        None, description="a failure's whole traceback (absent when it succeeded)"
    )

    @model_serializer(mode="wrap")
    def _without_an_empty_traceback(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("traceback") is None:
            data.pop("traceback", None)  # a success answers as it always did
        return data

    exit_code: int
    stdout: str
    stderr: str
    display: list[DisplayOutput] = Field(
        default_factory=list, description="display(obj), a rich last value, matplotlib figures"
    )
    display_truncated: bool = Field(False, description="outputs past 8 MiB were dropped")
    timed_out: bool = Field(False, description="interrupted at its timeout_s")


class EvalInterrupt(BaseModel):
    interrupted: bool = Field(description="false when no eval was running")


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    type: str
    size: int
    mode: int
    mtime: float


class FileWritten(BaseModel):
    path: str
    size: int
