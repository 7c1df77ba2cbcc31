"""What a command or an evaluation in a sandbox answered: output, exit code, result."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from forkd.client.connection import JSONDict


def exit_code_of(answer: dict[str, Any]) -> int:
    """The exit code in an exec/eval answer; 124 for a timeout, -1 when missing."""
    code = answer.get("exit_code")
    if code is None:
        return 124 if answer.get("timed_out") else -1
    return int(code)


@dataclass
class CommandResult:
    """What a command printed and how it exited (124: killed by its timeout)."""

    stdout: str
    stderr: str
    exit_code: int
    raw: JSONDict = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def timed_out(self) -> bool:
        """True when the command was killed by its timeout."""
        return bool(self.raw.get("timed_out", self.exit_code == 124))

    @classmethod
    def from_answer(cls, raw: JSONDict) -> CommandResult:
        """The result of an ``/exec`` answer."""
        return cls(raw.get("stdout") or "", raw.get("stderr") or "", exit_code_of(raw), raw)


@dataclass
class DisplayOutput:
    """One display output of an eval: ``display(obj)``, a rich last value, a figure.

    ``data`` is base64 for ``image/png`` and ``image/jpeg``, text otherwise.
    """

    mime: str
    data: str

    @property
    def content(self) -> bytes:
        """The output's bytes: the image decoded, or the text as UTF-8."""
        if self.mime in BINARY_MIMES:
            return base64.b64decode(self.data)
        return self.data.encode("utf-8")


BINARY_MIMES = frozenset({"image/png", "image/jpeg"})


@dataclass
class EvalResult:
    """The repr of the code's final expression (``result``, None for plain
    statements) or the error text (``error``), and what the code displayed."""

    result: str | None
    error: str | None
    exit_code: int
    stdout: str | None = None
    stderr: str | None = None
    raw: JSONDict = field(default_factory=dict, repr=False, compare=False)
    display: list[DisplayOutput] = field(default_factory=list, repr=False)

    @classmethod
    def from_answer(cls, raw: JSONDict) -> EvalResult:
        """From the HTTP API's (or the agent's) eval answer."""
        return cls(
            result=raw.get("result"),
            # Over the agent's TCP protocol 'error' is the last line, the whole text
            # in 'traceback' (as the original forkd agent answered).
            error=raw.get("traceback") or raw.get("error"),
            exit_code=int(raw.get("exit_code") or 0),
            stdout=raw.get("stdout"),
            stderr=raw.get("stderr"),
            raw=raw,
            display=[DisplayOutput(d["mime"], d["data"]) for d in raw.get("display") or []],
        )

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    @property
    def timed_out(self) -> bool:
        """True when the eval was interrupted at its timeout."""
        return bool(self.raw.get("timed_out"))


@dataclass
class OutputEvent:
    """One event of a process's output stream (``GET .../processes/{pid}/output``).

    ``kind`` is ``"stdout"``, ``"stderr"`` or ``"pty"`` (``data`` holds the
    bytes, from ``offset`` to ``next_offset``), ``"gap"`` (output from
    ``offset`` to ``next_offset`` was lost before it was read) or ``"exit"``
    (the last one: ``exit_code``).
    """

    kind: str
    data: bytes = b""
    offset: int | None = None
    next_offset: int | None = None
    exit_code: int | None = None

    @property
    def text(self) -> str:
        """``data`` as text (bytes that are not UTF-8 become U+FFFD)."""
        return self.data.decode("utf-8", "replace")
