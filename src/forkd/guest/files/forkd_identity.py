"""Who a command runs as: Docker's ``USER`` forms resolved against the image's own
/etc/passwd and /etc/group, and the defaults an image gave the agent (its
environment, working directory and user).

The files are read as Docker reads them, without NSS: an image may have no libc
at all, or one other than the agent's. Standard library only (runs in the guest).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

PASSWD = "/etc/passwd"
GROUP = "/etc/group"
MAX_FILE_BYTES = 4 * 1024 * 1024  # an /etc/passwd or /etc/group longer than this is not read
DEFAULTS_FILE = "/run/forkd-image.json"  # the image's defaults (tmpfs: in every snapshot of it)


@dataclass(frozen=True)
class Identity:
    """A uid, its primary gid, its supplementary groups and its home directory."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


ROOT = Identity(0, 0, (0,), "/root")


@dataclass(frozen=True)
class ImageDefaults:
    """What an image sets for every command that does not say otherwise."""

    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"env": self.env, "cwd": self.cwd, "user": self.user}


def _entries(path: str) -> list[list[str]]:
    """The colon-separated lines of ``path`` (none when it is missing or unreadable)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError:
        return []
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path} is longer than {MAX_FILE_BYTES} bytes")
    text = data.decode("utf-8", errors="replace")
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def names_by_id(path: str) -> dict[int, str]:
    """The names of /etc/passwd's users or /etc/group's groups, by id (the first of an
    id listed twice)."""
    found: dict[int, str] = {}
    for entry in _entries(path):
        number = _number(entry[2]) if len(entry) > 2 else None
        if number is not None:
            found.setdefault(number, entry[0])
    return found


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 10 else None


def _group_id(name: str) -> int:
    number = _number(name)
    if number is not None:
        return number
    for entry in _entries(GROUP):
        if len(entry) >= 3 and entry[0] == name and _number(entry[2]) is not None:
            return int(entry[2])
    raise ValueError(f"unable to find group {name}: no matching entries in {GROUP}")


def _supplementary(user_name: str | None, primary: int) -> tuple[int, ...]:
    """The primary group, then the groups /etc/group lists the user in (as runc sets them)."""
    found = [primary]
    if user_name is None:
        return tuple(found)
    for entry in _entries(GROUP):
        if len(entry) >= 4 and user_name in entry[3].split(","):
            gid = _number(entry[2])
            if gid is not None and gid not in found:
                found.append(gid)
    return tuple(found)


def resolve(spec: str) -> Identity:
    """``user``, ``uid``, ``user:group``, ``uid:gid`` (and mixes) as Docker resolves them:
    a uid the image does not list runs with gid 0 and home /; a name it does not list
    is a ValueError."""
    if not spec or "\0" in spec or len(spec) > 256:
        raise ValueError(f"invalid user {spec!r}")
    user_part, _, group_part = spec.partition(":")
    uid = _number(user_part)
    found: list[str] | None = None
    for entry in _entries(PASSWD):
        if len(entry) < 7 or _number(entry[2]) is None or _number(entry[3]) is None:
            continue
        if (uid is None and entry[0] == user_part) or (uid is not None and int(entry[2]) == uid):
            found = entry
            break
    if found is None and uid is None:
        raise ValueError(f"unable to find user {user_part}: no matching entries in {PASSWD}")
    if found is not None:
        uid, gid, home, name = int(found[2]), int(found[3]), found[5] or "/", found[0]
    else:
        gid, home, name = 0, "/", None
    assert uid is not None
    if group_part:
        gid = _group_id(group_part)
    return Identity(uid, gid, _supplementary(name, gid), home)


def parse_defaults(req: dict[str, Any]) -> ImageDefaults:
    """The ``configure`` op's fields, checked."""
    env = req.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        raise ValueError("'env' must map variable names to strings")
    cwd = req.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd):
        raise ValueError("'cwd' must be an absolute path or null")
    user = req.get("user")
    if user is not None and (not isinstance(user, str) or not user or "\0" in user):
        raise ValueError("'user' must be a non-empty string or null")
    return ImageDefaults(dict(env), cwd, user)


def save_defaults(defaults: ImageDefaults) -> None:
    tmp = DEFAULTS_FILE + ".tmp"
    with open(tmp, "w") as f:
        json.dump(defaults.to_json(), f)
    os.replace(tmp, DEFAULTS_FILE)


def load_defaults() -> ImageDefaults:
    """What an agent of this boot was told (a respawned agent keeps it); else none."""
    with contextlib.suppress(OSError, ValueError), open(DEFAULTS_FILE) as f:
        return parse_defaults(json.load(f))
    return ImageDefaults()
