"""Flattening an image's layers in a process of its own.

The layers are hostile input, and merging them (:func:`forkd.image_import.squash.build_rootfs`)
is the heaviest thing an import does in Python: up to a million entries, tens of
seconds of CPU and hundreds of MiB. Done in the daemon, that CPU would contend with
its event loop for the interpreter lock and that memory would stay in its heap; a
bug the layer found would be the daemon's. Here a worker
(``python -m forkd.image_import.flatten_worker``) does it at a lower CPU priority,
its memory goes back when it exits, and whatever befalls it ends only the import.

:func:`build_rootfs` has the same signature and errors as squash's. The parent
writes one JSON request on the worker's stdin; the worker answers in JSON lines on
its stdout: ``{"progress": text}`` as it goes, then ``{"stats": {...}}`` or
``{"error": {"kind": ..., "message": ...}}``. Its stderr goes to a log in ``work``,
whose tail a worker that died without an answer is reported with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from forkd import import_deadline
from forkd.archive.errors import ArchiveError, ArchiveTooLarge, BadArchive, UnsafeEntry
from forkd.archive.tar_format import Limits
from forkd.disk_reserve import DiskReserve
from forkd.errors import ImageError, NoRoom, StorageFull, TimedOut
from forkd.image_import import leftovers
from forkd.image_import.layers import IMAGE_LIMITS, Progress
from forkd.image_import.model import LayerBlob, RootfsStats

NICENESS = 10  # the worker yields the CPU to the daemon and its VMs
WATCH_SECS = 0.25  # how often the disk's free space and the deadline are looked at
LINE_MAX_BYTES = 64 << 10  # one answer line (progress text is short; names are cut)
LOG_TAIL_BYTES = 2000
# What the worker may answer with, raised as it was in the parent; anything else is
# an ImageError saying so.
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (BadArchive, UnsafeEntry, ArchiveTooLarge, ArchiveError, StorageFull, ImageError)
}


def build_rootfs(
    layers: Sequence[LayerBlob],
    out: Path,
    work: Path,
    *,
    limits: Limits = IMAGE_LIMITS,
    progress: Progress | None = None,
    run_as: tuple[int, int] | None = None,
    reserve: DiskReserve | None = None,
    started: Callable[[int], None] | None = None,
) -> RootfsStats:
    """:func:`forkd.image_import.squash.build_rootfs`, run in a worker process; with a
    ``reserve``, stopped (:class:`~forkd.errors.NoRoom`) once the disk it writes on is
    down to it. ``started`` is told the worker's pid (a uid leased for its tar2sqfs is
    then held by it: the worker dies with this process, and tar2sqfs with the worker)."""
    from forkd.image_import import squash

    squash.require_tool()  # said here, as the caller expects it, not by the worker
    if reserve is not None:
        reserve.require(0, "flattening the image's layers")
    request = _request(layers, out, work, limits, run_as)
    log_path = work / "flatten-worker.log"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            close_fds=True,
        )
        watch = _Watch(proc, reserve, import_deadline.deadline())
        try:
            with leftovers.recorded_worker(proc.pid):
                if started is not None:
                    started(proc.pid)
                assert proc.stdin is not None and proc.stdout is not None
                with contextlib.suppress(BrokenPipeError), proc.stdin:  # gone: its log says
                    proc.stdin.write(json.dumps(request).encode())
                answer = _read_answer(proc.stdout, progress)
                code = proc.wait()
        except BaseException:  # the import was cancelled or the daemon stops
            proc.kill()
            proc.wait()
            raise
        finally:
            watch.stop()
        if watch.refused is not None:
            raise watch.refused
        if answer is None:
            raise _no_answer(log, code)
    return _result(answer)


def _request(
    layers: Sequence[LayerBlob],
    out: Path,
    work: Path,
    limits: Limits,
    run_as: tuple[int, int] | None,
) -> dict[str, Any]:
    """What the worker is asked to do, as it reads it (JSON) on its stdin."""
    return {
        "layers": [{**dataclasses.asdict(layer), "path": str(layer.path)} for layer in layers],
        "out": str(out),
        "work": str(work),
        "limits": dataclasses.asdict(limits),
        "run_as": list(run_as) if run_as is not None else None,
        "parent": os.getpid(),
    }


def _no_answer(log: IO[bytes], code: int) -> ImageError:
    """The error of a worker that exited without an answer: its status and its log's end."""
    log.seek(0)
    tail = log.read()[-LOG_TAIL_BYTES:].decode(errors="replace").strip()
    return ImageError(
        f"flattening the layers failed: the worker exited with status {code} "
        f"without an answer{': ' + tail if tail else ''}"
    )


class _Watch:
    """Kills the worker once the disk is down to the reserve (what it writes, the layers'
    data and the squashfs image, has no size known beforehand) or the import is past
    its deadline (a million entries cost minutes of CPU: the import's time, not the
    daemon's)."""

    def __init__(
        self, proc: subprocess.Popen[bytes], reserve: DiskReserve | None, deadline: float | None
    ) -> None:
        self.proc, self.reserve, self.deadline = proc, reserve, deadline
        self.refused: NoRoom | TimedOut | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="forkd-flatten-watch")
        if reserve is not None or deadline is not None:  # else nothing to watch
            self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_SECS):
            try:
                if self.reserve is not None:
                    self.reserve.require(0, "flattening the image's layers")
                if self.deadline is not None and time.monotonic() > self.deadline:
                    raise TimedOut(
                        "flattening the image's layers ran past --import-timeout: stopped"
                    )
            except (NoRoom, TimedOut) as exc:
                self.refused = exc
                self.proc.kill()
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()


def _read_answer(stdout: IO[bytes], progress: Progress | None) -> dict[str, Any] | None:
    """The worker's last line (its stats or its error), passing progress on; None if
    it ended without one."""
    while line := stdout.readline(LINE_MAX_BYTES + 1):
        try:
            msg = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            msg = None
        if not isinstance(msg, dict):
            raise ImageError("flattening the layers failed: the worker's answer is malformed")
        if "progress" in msg:
            if progress is not None:
                progress(str(msg["progress"]))
            continue
        return dict(msg)
    return None


def _result(answer: dict[str, Any]) -> RootfsStats:
    if "stats" in answer:
        return RootfsStats(**answer["stats"])
    error = answer.get("error") or {}
    message = str(error.get("message", "no message"))
    kind = ERRORS.get(str(error.get("kind")))
    if kind is None:
        raise ImageError(f"flattening the layers failed: {error.get('kind')}: {message}")
    raise kind(message)


# ------------------------------------------------------------------ the worker


def _kind(exc: BaseException) -> str:
    """The name of the first of ``ERRORS`` that ``exc`` is, else its own class's."""
    for cls in type(exc).__mro__:
        if cls.__name__ in ERRORS and ERRORS[cls.__name__] is cls:
            return cls.__name__
    return type(exc).__name__


def _say(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def main() -> int:
    from forkd.image_import import squash

    leftovers.die_with_parent()
    os.nice(NICENESS)
    request = json.load(sys.stdin)
    if os.getppid() != request["parent"]:  # the parent went before the signal was set
        return 1
    layers = [LayerBlob(**{**raw, "path": Path(raw["path"])}) for raw in request["layers"]]
    run_as = request["run_as"]
    try:
        stats = squash.build_rootfs(
            layers,
            Path(request["out"]),
            Path(request["work"]),
            limits=Limits(**request["limits"]),
            progress=lambda text: _say({"progress": text}),
            run_as=(int(run_as[0]), int(run_as[1])) if run_as else None,
        )
    except Exception as exc:  # said to the parent, which raises it as it was
        _say({"error": {"kind": _kind(exc), "message": str(exc)}})
        return 1
    _say({"stats": dataclasses.asdict(stats)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
