"""An explore's variants, scored and chosen: each variant's outcome as it goes, the
score parsed from what its step printed (the guest's text: only its end is read), the
order best first, and the ones kept."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from forkd.controller.models import ExploreVariant

SCORE_TAIL_CHARS = 4096
SCORE_LINE_CHARS = 128
_WRAPPED_NUMBER = re.compile(r"[A-Za-z_][\w.]*\(([^()]*)\)")  # np.float64(2.5); linear


class StepFailed(Exception):
    """A variant's step or score did not give what it must; the message says why."""


@dataclass
class Outcome:
    """One variant, as it goes."""

    index: int
    sandbox_id: str
    score: float | None = None
    exit_code: int | None = None
    stdout_tail: str = ""
    score_tail: str = ""
    error: str | None = None
    kept: bool = False
    snapshot_tag: str | None = None
    duration_ms: float = 0.0

    def result(self) -> ExploreVariant:
        return ExploreVariant(
            index=self.index,
            sandbox_id=self.sandbox_id,
            score=self.score,
            exit_code=self.exit_code,
            stdout_tail=self.stdout_tail,
            score_tail=self.score_tail,
            error=self.error,
            kept=self.kept,
            snapshot_tag=self.snapshot_tag,
            duration_ms=round(self.duration_ms, 1),
        )


def parse_score(text: str | None, what: str) -> float:
    """The number ``text`` is: the last non-empty line of an exec's stdout, or an eval's
    result (a repr: ``3``, ``0.5``, ``np.float64(0.5)``). :class:`StepFailed` else.
    The text is the guest's: only its end is looked at, and a long line is no number."""
    tail = (text or "")[-SCORE_TAIL_CHARS:]
    last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), None)
    if last is None:
        raise StepFailed(f"{what} gave no number (it printed nothing)")
    if len(last) > SCORE_LINE_CHARS:
        raise StepFailed(f"{what} gave no number: its last line is {len(last)} characters")
    wrapped = _WRAPPED_NUMBER.fullmatch(last)
    try:
        value = float(wrapped.group(1).strip() if wrapped else last)
    except ValueError:
        raise StepFailed(f"{what} gave no number: its last line is {last!r}") from None
    if not math.isfinite(value):
        raise StepFailed(f"{what} gave {last!r}: a score is a finite number")
    return value


def ranked(outcomes: list[Outcome], minimize: bool) -> list[Outcome]:
    """Best first: scored ones by score (ties by index), then the unscored by index."""
    sign = 1.0 if minimize else -1.0
    return sorted(
        outcomes,
        key=lambda o: (o.score is None, 0.0 if o.score is None else sign * o.score, o.index),
    )


def chosen(order: list[Outcome], keep: int, scored: bool) -> list[Outcome]:
    """The ``keep`` best that succeeded (with a score step: those with a score)."""
    good = [o for o in order if (o.score is not None if scored else o.error is None)]
    return good[:keep]
