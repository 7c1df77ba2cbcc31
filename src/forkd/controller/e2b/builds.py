"""E2B's template builds as the daemon holds them: each build's state and log, and the
files its COPY steps upload, kept under the state directory until the build has used
them.

A build lives in the daemon's memory (its template, once built, is an ordinary forkd
snapshot and survives restarts; a build cut off by a restart is simply gone, and its
uploads are removed at the next start). Uploads go to a URL this module signs, as
E2B's SDK puts them to a presigned URL: the URL is the credential, good for one build's
one file, on this run of the daemon.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from forkd.controller.services.events import utc_stamp
from forkd.controller.services.received import receive_to
from forkd.controller.settings import Settings
from forkd.disk_reserve import DiskReserve
from forkd.errors import Conflict, Invalid, NotFound, OverCapacity

Status = Literal["waiting", "building", "ready", "error"]
FILES_HASH = re.compile(r"^[0-9a-f]{64}$")  # E2B's files hash: a sha256, in hex
MAX_BUILDS = 32  # builds held at once (waiting, building, or finished and still asked of)
MAX_FILES = 256  # uploads of one build
MAX_LOG_ENTRIES = 10_000  # of one build's log; past it one entry says the rest was cut
MAX_LOG_CHARS = 4 << 20  # of one build's log, all its entries
MAX_LINE_CHARS = 8 << 10  # of one entry (a line of a step's output)
KEEP_FINISHED_SECS = 3600.0  # a finished build answers its status this long
UPLOAD_SECS = 3600.0  # a build not started this long after its request is dropped


@dataclass
class Build:
    """One E2B build of the template ``name`` (the forkd snapshot tag it makes)."""

    name: str
    cpu_count: int | None
    memory_mb: int | None
    build_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    status: Status = "waiting"
    entries: list[dict[str, Any]] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    files: dict[str, Path] = field(default_factory=dict)  # files hash -> the upload
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None
    task: asyncio.Task[None] | None = None
    log_chars: int = 0
    cut: bool = False
    receiving: set[str] = field(default_factory=set)  # files hashes being uploaded now

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        """One entry of the build's log; past :data:`MAX_LOG_ENTRIES` entries or
        :data:`MAX_LOG_CHARS` characters, one last entry says the rest was cut."""
        if self.cut:
            return
        message = message[:MAX_LINE_CHARS]
        self.log_chars += len(message)
        if len(self.entries) >= MAX_LOG_ENTRIES or self.log_chars > MAX_LOG_CHARS:
            self.cut = True
            level, message = "warn", "(the rest of the build's log was cut)"
        entry: dict[str, Any] = {"timestamp": utc_stamp(), "level": level, "message": message}
        if step is not None:
            entry["step"] = step
        self.entries.append(entry)

    def fail(self, message: str, step: str | None) -> None:
        message = message[:MAX_LINE_CHARS]
        entry: dict[str, Any] = {"timestamp": utc_stamp(), "level": "error", "message": message}
        if step is not None:
            entry["step"] = step
        self.entries.append(entry)  # whatever was cut before it
        self.status = "error"
        self.reason = {"message": message, **({"step": step} if step is not None else {})}

    @property
    def active(self) -> bool:
        return self.status in ("waiting", "building")


class Builds:
    """The builds of one daemon run, and the directory their uploads are kept in
    (``root``: emptied now, so what an earlier run left is gone)."""

    def __init__(self, root: Path, reserve_mib: int, upload_limit: int) -> None:
        self.root = root
        self.reserve = DiskReserve(root.parent, reserve_mib << 20)
        self.upload_limit = upload_limit
        self._key = os.urandom(32)
        self._builds: dict[str, Build] = {}
        shutil.rmtree(root, ignore_errors=True)

    @classmethod
    def in_state_dir(cls, settings: Settings, upload_limit: int) -> Builds:
        """The builds of the daemon ``settings`` describe, their uploads in its state dir."""
        return cls(settings.state_dir / "e2b-builds", settings.disk_reserve_mib, upload_limit)

    def request(self, name: str, cpu_count: int | None, memory_mb: int | None) -> Build:
        self._forget_old()
        if any(b.name == name and b.active for b in self._builds.values()):
            raise Conflict(f"template {name!r} is being built: wait for that build to end")
        if len(self._builds) >= MAX_BUILDS:  # the oldest finished one makes room
            done = [b for b in self._builds.values() if b.finished is not None]
            if not done:
                raise OverCapacity(f"{MAX_BUILDS} template builds are running: retry later")
            del self._builds[min(done, key=lambda b: b.finished or 0.0).build_id]
        build = Build(name, cpu_count, memory_mb)
        self._builds[build.build_id] = build
        return build

    def holds(self, build_id: str) -> bool:
        return build_id in self._builds

    def get(self, name: str, build_id: str) -> Build:
        build = self._builds.get(build_id)
        if build is None or build.name != name:
            raise NotFound(f"no build {build_id!r} of template {name!r}")
        return build

    def latest(self, name: str) -> Build:
        """The build of ``name`` that is waiting for its files (E2B asks for an upload
        link by template, not by build)."""
        waiting = [b for b in self._builds.values() if b.name == name and b.status == "waiting"]
        if not waiting:
            raise NotFound(f"no build of template {name!r} is waiting for its files")
        return max(waiting, key=lambda b: b.created)

    def signature(self, build_id: str, files_hash: str) -> str:
        message = f"{build_id}/{files_hash}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    async def receive(
        self, build_id: str, files_hash: str, signature: str, body: AsyncIterator[bytes]
    ) -> int:
        """An upload to a URL :meth:`signature` signed, kept for the build's COPY: one
        upload of a file at a time, its own part file renamed into place only while the
        build still waits for its files."""
        expected = self.signature(build_id, files_hash).encode()
        if not hmac.compare_digest(signature.encode("utf-8", "replace"), expected):
            raise NotFound("no such upload: the link is not one this daemon gave")
        build = self._waiting(build_id)
        if len(build.files) >= MAX_FILES and files_hash not in build.files:
            raise Invalid(f"a build takes at most {MAX_FILES} uploads")
        if files_hash in build.receiving:
            raise Conflict("this file is being uploaded already")
        directory = self.root / build_id
        directory.mkdir(parents=True, exist_ok=True)
        part = directory / f"{files_hash}.{uuid.uuid4().hex}.part"
        meter = self.reserve.meter(f"receiving build {build_id}'s files")
        build.receiving.add(files_hash)
        try:
            with part.open("wb") as out:
                size = await receive_to(
                    body, out, self.upload_limit, meter, "the files", "--max-upload-mib"
                )
            self._waiting(build_id)  # not started (nor ended) while this came in
            final = directory / files_hash
            part.replace(final)
        finally:
            build.receiving.discard(files_hash)
            part.unlink(missing_ok=True)
        build.files[files_hash] = final
        return size

    def _waiting(self, build_id: str) -> Build:
        build = self._builds.get(build_id)
        if build is None or build.status != "waiting":
            raise Conflict("the build has started or ended: its files are taken already")
        return build

    def finished(self, build: Build) -> None:
        """The build ended: its uploads are dropped."""
        build.finished = time.monotonic()
        build.files.clear()
        shutil.rmtree(self.root / build.build_id, ignore_errors=True)

    def _forget_old(self) -> None:
        now = time.monotonic()
        for build in list(self._builds.values()):
            stale_wait = build.status == "waiting" and now - build.created > UPLOAD_SECS
            old = build.finished is not None and now - build.finished > KEEP_FINISHED_SECS
            if stale_wait:
                self.finished(build)
            if stale_wait or old:
                del self._builds[build.build_id]
