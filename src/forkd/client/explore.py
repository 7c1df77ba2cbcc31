"""Explore and diff from the client's side: the variants a user writes, the typed answers.

A variant (or the score) is given as:

- a string: a shell command, run as ``sh -c STRING``;
- a list of strings: a program and its arguments, run as they are;
- a dict: the wire form, ``{"exec": [...], "env": {...}, "stdin": ..., "cwd": ...,
  "user": ...}`` or ``{"eval": "python code"}`` (docs/API.md, "Explore").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypedDict

from forkd.client.connection import JSONDict

Step: TypeAlias = str | Sequence[str] | dict[str, Any]


class ExploreOptions(TypedDict, total=False):
    """An explore's keywords beside its variants and score, as ``Sandbox.explore`` and
    ``AsyncSandbox.explore`` take them (``Controller.explore_sandbox`` documents each)."""

    keep: int  # how many of the best to keep (default 1)
    keep_as: str | None  # "sandboxes" (default) or "snapshots"
    minimize: bool  # lower scores are better
    timeout_secs: float | None  # bounds every variant (default 300)
    seed: int | None  # variant i's child gets seed + i
    tag: str | None  # the branch the children are forked from
    metadata: dict[str, str] | None  # labels of every child


def step_body(step: Step) -> JSONDict:
    """``step`` in its wire form."""
    if isinstance(step, str):
        return {"exec": ["sh", "-c", step]}
    if isinstance(step, dict):
        return dict(step)
    argv = list(step)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"a step is a shell string, an argv of strings or a dict: {step!r}")
    return {"exec": argv}


@dataclass
class VariantResult:
    """What one variant did; ``score`` is None when it failed (``error`` says why)."""

    index: int
    sandbox_id: str | None
    score: float | None
    exit_code: int | None
    stdout_tail: str
    error: str | None
    kept: bool
    snapshot_tag: str | None = None
    duration_ms: float = 0.0
    score_tail: str = ""  # the end of what its score step printed (an eval's result)

    @classmethod
    def from_answer(cls, raw: JSONDict) -> VariantResult:
        return cls(
            index=int(raw["index"]),
            sandbox_id=raw.get("sandbox_id"),
            score=raw.get("score"),
            exit_code=raw.get("exit_code"),
            stdout_tail=raw.get("stdout_tail") or "",
            error=raw.get("error"),
            kept=bool(raw.get("kept")),
            snapshot_tag=raw.get("snapshot_tag"),
            duration_ms=float(raw.get("duration_ms") or 0),
            score_tail=raw.get("score_tail") or "",
        )


@dataclass
class ExploreResult:
    """An explore's answer: its ``results`` best first (failed variants last)."""

    branch: str
    pause_ms: int | None
    fork_ms: float
    duration_ms: float
    branch_kept: bool
    results: list[VariantResult]
    raw: JSONDict = field(default_factory=dict, repr=False, compare=False)

    @property
    def best(self) -> VariantResult | None:
        """The best scored variant (with no score step: the first that succeeded)."""
        return next((r for r in self.results if r.error is None), None)

    @property
    def kept(self) -> list[VariantResult]:
        """The variants whose child runs on (or was kept as ``snapshot_tag``)."""
        return [r for r in self.results if r.kept]

    @classmethod
    def from_answer(cls, raw: JSONDict) -> ExploreResult:
        return cls(
            branch=raw["branch"],
            pause_ms=raw.get("pause_ms"),
            fork_ms=float(raw.get("fork_ms") or 0),
            duration_ms=float(raw.get("duration_ms") or 0),
            branch_kept=bool(raw.get("branch_kept")),
            results=[VariantResult.from_answer(r) for r in raw.get("results", [])],
            raw=raw,
        )


@dataclass
class FileChange:
    """One path a sandbox changed: ``change`` is added, modified or removed; ``kind``
    file, dir, symlink or other."""

    path: str
    change: str
    kind: str
    size: int
    mode: int


@dataclass
class DiffResult:
    """What a sandbox changed under ``path`` against ``against`` (a snapshot or a
    sandbox: ``against_kind``), its ``changes`` sorted by path."""

    sandbox_id: str
    against: str
    against_kind: str
    path: str
    changes: list[FileChange]
    truncated: bool
    duration_ms: float
    raw: JSONDict = field(default_factory=dict, repr=False, compare=False)

    def of(self, change: str) -> list[str]:
        """The paths ``added``, ``modified`` or ``removed``."""
        return [c.path for c in self.changes if c.change == change]

    @classmethod
    def from_answer(cls, raw: JSONDict) -> DiffResult:
        return cls(
            sandbox_id=raw["sandbox_id"],
            against=raw["against"],
            against_kind=raw.get("against_kind", "snapshot"),
            path=raw["path"],
            changes=[
                FileChange(
                    c["path"], c["change"], c.get("kind", "file"), int(c["size"]), int(c["mode"])
                )
                for c in raw.get("changes", [])
            ],
            truncated=bool(raw.get("truncated")),
            duration_ms=float(raw.get("duration_ms") or 0),
            raw=raw,
        )
