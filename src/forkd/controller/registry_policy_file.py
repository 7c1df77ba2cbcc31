"""Which registries and archive directories a daemon may use, from a file it reads again
when it changes (``forkd serve --registry-policy FILE``), or on SIGHUP: opening or
closing a registry needs no restart, so no sandbox is lost to one.

The file is TOML::

    insecure_registries = ["registry.internal:5000"]   # plain HTTP, and loopback ones
    default_registry = "registry.example.com"          # where python:3.12 points
    image_archive_dirs = ["/srv/images"]               # docker-archive:, oci-archive:, oci:

What it lists is added to what the command line gave (its ``default_registry``
replaces the flag's). A file that does not parse, names a registry or directory
that is not one, or that someone besides root and the daemon's user could change
(the file or its directory), is logged and ignored: the policy in force stays as it
was. A file removed leaves the command line's policy alone.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.errors import ForkdError
from forkd.oci.policy import RegistryPolicy
from forkd.oci.reference import check_registry

log = logging.getLogger(__name__)
MAX_FILE_BYTES = 64 << 10
KEYS = {"insecure_registries", "default_registry", "image_archive_dirs"}


@dataclass(frozen=True)
class RegistryChoices:
    """The registry policy in force: what ``Settings`` holds of it."""

    insecure_registries: tuple[str, ...] = ()
    default_registry: str | None = None
    image_archive_dirs: tuple[Path, ...] = ()


@dataclass
class PolicyFile:
    """``path``, over the command line's ``flags``; :meth:`current` the policy now."""

    path: Path
    flags: RegistryChoices
    _seen: tuple[int, int, int] | None = None  # mtime_ns, size, inode of the file read
    _current: RegistryChoices | None = None
    _forced: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self) -> None:
        """Read the file now; ValueError saying what is wrong with it (at the start, a
        bad file stops the daemon; later, a bad edit only keeps the policy in force)."""
        try:
            self._merged(_read(self.path) if self.path.exists() else {})
        except (ForkdError, ValueError, OSError) as exc:
            raise ValueError(f"--registry-policy {self.path}: {exc}") from exc
        self.current()

    def reload_now(self) -> None:
        """Read the file at the next use whether or not it changed (SIGHUP)."""
        self._forced = True

    def current(self) -> RegistryChoices:
        """The policy, the file read again first if it changed since it was last read."""
        with self._lock:
            try:
                st = os.stat(self.path)
                seen: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
            except OSError:
                seen = None
            if self._current is not None and seen == self._seen and not self._forced:
                return self._current
            self._forced = False
            self._seen = seen
            try:
                loaded = self._merged(_read(self.path) if seen is not None else {})
            except (ForkdError, ValueError, OSError) as exc:
                log.error(
                    "registry policy %s not applied (%s); the one in force stays", self.path, exc
                )
                return self._current or self.flags
            if loaded != self._current:
                log.info(
                    "registry policy from %s: insecure %s, default %s, archive dirs %s",
                    self.path,
                    list(loaded.insecure_registries) or "none",
                    loaded.default_registry or "none",
                    [str(d) for d in loaded.image_archive_dirs] or "none",
                )
            self._current = loaded
            return loaded

    def _merged(self, body: dict[str, Any]) -> RegistryChoices:
        unknown = set(body) - KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} (known: {sorted(KEYS)})")
        insecure = _strings(body, "insecure_registries")
        for entry in insecure:
            check_registry(entry, "insecure_registries entry")
        default = body.get("default_registry", self.flags.default_registry)
        if default is not None and not isinstance(default, str):
            raise ValueError("default_registry must be a string")
        dirs = [Path(d) for d in _strings(body, "image_archive_dirs")]
        for d in dirs:
            if not d.is_absolute():
                raise ValueError(f"image_archive_dirs entry {str(d)!r} is not an absolute path")
        merged = RegistryChoices(
            insecure_registries=tuple(dict.fromkeys([*self.flags.insecure_registries, *insecure])),
            default_registry=default,
            image_archive_dirs=tuple(
                dict.fromkeys([*self.flags.image_archive_dirs, *(d.resolve() for d in dirs)])
            ),
        )
        RegistryPolicy.of(merged.insecure_registries, merged.default_registry)  # checks both
        return merged


def _read(path: Path) -> dict[str, Any]:
    _check_trusted(path)
    with path.open("rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return tomllib.loads(data.decode())


def _check_trusted(path: Path) -> None:
    """ValueError unless only the daemon's user (or root) can change ``path``: the file
    and its directory owned by one of them and writable by no one else. The policy says
    which host files the daemon reads for clients and where it sends their requests."""
    me = os.geteuid()
    for what, st in (("the file", os.stat(path)), ("its directory", os.stat(path.parent))):
        if st.st_uid not in (0, me):
            raise ValueError(f"{what} belongs to uid {st.st_uid}, not root or the daemon's")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ValueError(f"{what} may be written by other users (mode {st.st_mode & 0o777:o})")


def _strings(body: dict[str, Any], key: str) -> list[str]:
    value = body.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of strings")
    return value
