"""E2B's pages: ``limit`` items after the one ``nextToken`` names, and the
``x-next-token`` header naming the last of them while more follow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from forkd.errors import Invalid

T = TypeVar("T")


def paged(
    found: Sequence[T], key: Callable[[T], str], limit: int, next_token: str | None, what: str
) -> tuple[list[T], dict[str, str]]:
    """The page of ``found`` (in its order) and the headers to answer it with."""
    start = 0
    if next_token is not None:
        keys = [key(item) for item in found]
        if next_token not in keys:
            raise Invalid(f"nextToken {next_token!r} names no {what} of this listing")
        start = keys.index(next_token) + 1
    page = list(found[start : start + limit])
    more = start + limit < len(found)
    return page, {"x-next-token": key(page[-1])} if more and page else {}
