"""Explore and diff: variants tried in copies of a sandbox, and what a sandbox changed."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from forkd import limits
from forkd.controller.models.common import Metadata, StrictBody
from forkd.controller.models.network import NetworkPolicy


class ExploreStep(StrictBody):
    """One command run in a child of an explore: ``exec`` (a program and its arguments,
    never through a shell unless it is one) or ``eval`` (Python in the warm interpreter)."""

    exec: list[str] | None = Field(None, min_length=1, description="argv, as exec's args")
    eval: str | None = Field(None, description="Python, as eval's code")
    env: dict[str, str] | None = Field(None, description="exec only")
    stdin: str | None = Field(None, description="exec only")
    cwd: str | None = Field(None, description="exec only")
    user: str | None = Field(None, min_length=1, max_length=256, description="exec only")
    network: NetworkPolicy | None = Field(
        None,
        description="(a variant) what its child may reach, set before it runs; "
        "default: the source's policy at the branch",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> ExploreStep:
        if (self.exec is None) == (self.eval is None):
            raise ValueError("a step is exactly one of exec (argv) or eval (code)")
        given = [k for k in ("env", "stdin", "cwd", "user") if getattr(self, k) is not None]
        if self.eval is not None and given:
            raise ValueError(f"{', '.join(given)} go with exec, not eval")
        return self


class ExploreRequest(StrictBody):
    variants: list[ExploreStep] = Field(
        min_length=1,
        max_length=limits.MAX_EXPLORE_VARIANTS,
        description="one child per variant, each running its step",
    )
    score: ExploreStep | None = Field(
        None,
        description="run in each child after its variant: an exec whose stdout's last line, "
        "or an eval whose result, is a number. None: no scores, results in variant order",
    )
    keep: int = Field(
        1,
        ge=0,
        le=limits.MAX_EXPLORE_VARIANTS,
        description="children kept, best first; the rest are killed",
    )
    keep_as: Literal["sandboxes", "snapshots"] = Field(
        "sandboxes", description="snapshots: each kept child is branched, then killed"
    )
    minimize: bool = Field(False, description="lower scores are better")
    timeout_secs: float = Field(
        limits.EXPLORE_TIMEOUT_SECS,
        gt=0,
        le=limits.MAX_EXEC_TIMEOUT_SECS,
        description="from the request on: a variant's step or score still running then is "
        "its error; the branch, the fork and the keeping are never cut short",
    )
    seed: int | None = Field(
        None, ge=0, le=limits.MAX_SEED, description="variant i's child gets seed+i"
    )
    tag: str | None = Field(
        None,
        pattern=limits.NAME_PATTERN,
        description="the branch's tag, which names the explore; default explore-<sandbox id>-<n>",
    )
    metadata: Metadata | None = Field(
        None, description="labels of every child, merged; forkd.* keys are the explore's"
    )

    @model_validator(mode="after")
    def _keep_fits(self) -> ExploreRequest:
        reserved = sorted(k for k in self.metadata or {} if k.startswith("forkd."))
        if reserved:
            raise ValueError(f"metadata keys {', '.join(reserved)}: forkd.* labels are forkd's")
        if self.keep > len(self.variants):
            raise ValueError(f"keep {self.keep} is more than the {len(self.variants)} variants")
        if self.seed is not None and self.seed + len(self.variants) - 1 > limits.MAX_SEED:
            raise ValueError(f"seed + variants - 1 is over {limits.MAX_SEED}")
        if self.score is not None and self.score.network is not None:
            raise ValueError("network goes with a variant: the score runs in its variant's child")
        return self


class ExploreVariant(BaseModel):
    """What one variant of an explore did."""

    index: int = Field(description="its place in the request's variants")
    sandbox_id: str | None = Field(description="its child (killed unless kept)")
    score: float | None = Field(description="null when its step or score failed (see error)")
    exit_code: int | None = Field(description="its step's exit code (eval: 0, or 1 raised)")
    stdout_tail: str = Field(description="the end of its step's stdout (2048 characters)")
    score_tail: str = Field("", description="the end of its score's stdout (eval: its result)")
    error: str | None = Field(description="why it has no score; null when it has one")
    kept: bool = Field(
        description="its child runs on, or was branched into snapshot_tag (keep_as snapshots)"
    )
    snapshot_tag: str | None = Field(None, description="keep_as snapshots: its snapshot")
    duration_ms: float = Field(description="its step and score, in the guest and back")


class ExploreResult(BaseModel):
    branch: str = Field(
        description="the snapshot the children were forked from; its tag "
        "names the explore (label forkd.explore)"
    )
    pause_ms: int | None = Field(description="the source's pause for the branch")
    fork_ms: float = Field(description="forking every child")
    duration_ms: float = Field(description="the whole explore")
    branch_kept: bool = Field(description="false: the branch was deleted (no child maps it)")
    results: list[ExploreVariant] = Field(description="best first; failed variants last")


class DiffChange(BaseModel):
    path: str
    change: Literal["added", "modified", "removed"]
    kind: Literal["file", "dir", "symlink", "other"]
    size: int = Field(
        description="bytes (a symlink: its target's length; a directory: 0); removed: what it was"
    )
    mode: int = Field(description="permission bits, e.g. 420 (0o644)")


class DiffResult(BaseModel):
    sandbox_id: str
    against: str = Field(description="the snapshot tag or sandbox id compared with")
    against_kind: Literal["snapshot", "sandbox"]
    path: str = Field(description="the directory (or file) compared")
    changes: list[DiffChange] = Field(description="sorted by path")
    truncated: bool = Field(description="more changes than the daemon lists: diff a smaller path")
    duration_ms: float
