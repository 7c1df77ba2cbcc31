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
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from forkd.archive.errors import ArchiveError, ArchiveTooLarge, BadArchive, UnsafeEntry
from forkd.archive.tar_format import Limits
from forkd.errors import ImageError, StorageFull
from forkd.image_import.layers import IMAGE_LIMITS, Progress
from forkd.image_import.model import LayerBlob, RootfsStats

NICENESS = 10  # the worker yields the CPU to the daemon and its VMs
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
) -> RootfsStats:
    """:func:`forkd.image_import.squash.build_rootfs`, run in a worker process."""
    from forkd.image_import import squash

    squash.require_tool()  # said here, as the caller expects it, not by the worker
    request = {
        "layers": [{**dataclasses.asdict(layer), "path": str(layer.path)} for layer in layers],
        "out": str(out),
        "work": str(work),
        "limits": dataclasses.asdict(limits),
        "run_as": list(run_as) if run_as is not None else None,
    }
    log_path = work / "flatten-worker.log"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            close_fds=True,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            with contextlib.suppress(BrokenPipeError), proc.stdin:  # gone: its log says why
                proc.stdin.write(json.dumps(request).encode())
            answer = _read_answer(proc.stdout, progress)
            code = proc.wait()
        except BaseException:  # the import was cancelled or the daemon stops
            proc.kill()
            proc.wait()
            raise
        if answer is None:
            log.seek(0)
            tail = log.read()[-LOG_TAIL_BYTES:].decode(errors="replace").strip()
            raise ImageError(
                f"flattening the layers failed: the worker exited with status {code} "
                f"without an answer{': ' + tail if tail else ''}"
            )
    return _result(answer)


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

    os.nice(NICENESS)
    request = json.load(sys.stdin)
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
