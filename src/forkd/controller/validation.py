"""Checks on user input, done before anything on disk is touched."""

from __future__ import annotations

import re

from forkd.controller.errors import ApiError

TAG_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):
        raise ApiError(
            400, f"invalid tag {tag!r}: tags are 1-64 characters of A-Z, a-z, 0-9, '_' and '-'"
        )
    return tag


def check_guest_path(path: object) -> str:
    """A path inside the sandbox: absolute, no NUL byte."""
    if not isinstance(path, str) or not path:
        raise ApiError(400, "path is required")
    if "\x00" in path:
        raise ApiError(400, "path must not contain a NUL byte")
    if not path.startswith("/"):
        raise ApiError(400, f"path must be absolute (start with '/'), got {path!r}")
    return path
