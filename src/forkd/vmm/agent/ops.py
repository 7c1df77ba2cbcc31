"""A VM's guest as the daemon reaches it: the guest agent's operations
(docs/guest-agent.md), each a method of :class:`Guest`, which a VM holds as ``vm.guest``.

:class:`forkd.vmm.agent.client.AgentClient` is the transport (one
connection, requests matched to answers by id); this is what travels on it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from forkd import agent_wire as wire
from forkd import agent_wire_entries as entries
from forkd import limits
from forkd.errors import AgentError, SnapshotError, VMError
from forkd.vmm.agent.answers import bounded, checked, data_of, listed
from forkd.vmm.agent.client import ANSWER_WAIT_SECS, AgentClient

PING_WAIT_SECS = 10.0
# Between pings of an agent that is not answering yet, or answered wrongly: a guest that
# answers every ping with junk at once must not keep the daemon's loop parsing it.
PING_RETRY_SECS = 0.05
RESTORE_ERRORS_KEPT = 8  # of the guest's list of what failed, each cut to:
RESTORE_ERROR_CHARS = 300
EXEC_WAIT_MARGIN_SECS = 10.0  # beyond the command's own timeout, for the agent to answer
# An eval past its timeout is interrupted again and again for up to 5 s
# (forkd_eval.STOP_GRACE_S) before the agent answers without it.
EVAL_STOP_GRACE_SECS = 5.0
# The guest's exception names (AgentError.kind) when eval cannot run in a container
# image: it has no python3 on its PATH, or one too old (or broken) to run forkd's
# eval. Something of the sandbox's image, not of the request.
EVAL_IMAGE_REFUSALS = frozenset({"NoImagePython", "ImagePythonUnsupported"})
RESTORE_ENTROPY_BYTES = 64
PROC_READ_MAX_BYTES = 256 << 10  # of output in one proc_read answer (the agent allows 1 MiB)
COMMIT_WAIT_SECS = 300.0  # an upload's fsync, or a tar member's, may take long on a slow disk
# An open writes one chunk at most (and with a small file, syncs it): an agent that
# has not answered in this long is stuck, and the upload's client is told so.
OPEN_WAIT_SECS = PING_WAIT_SECS + EXEC_WAIT_MARGIN_SECS
# The agent's answer is of the shape forkd_wire says, or the call fails with this kind.

A = TypeVar("A")  # an op's answer
log = logging.getLogger(__name__)


def eval_wait_secs(timeout: float) -> float:
    """How long the host waits for an eval's answer: its timeout, the agent's
    grace for stopping it, and the margin every answer gets."""
    return timeout + EVAL_STOP_GRACE_SECS + EXEC_WAIT_MARGIN_SECS


def _no_qemu(what: str) -> None:
    """An agent with no QEMU behind it to die (one the tests run on the host)."""


async def _no_console() -> str:
    return "(none)"


class Guest:
    """The guest of VM ``vm_id`` through its agent's connection: the calls a sandbox's
    users make, and those a boot, a restore and a resume need. ``raise_if_dead(what)``
    raises if the VM's QEMU has exited; ``console()`` is the end of the guest's console,
    quoted when its agent does not answer."""

    def __init__(
        self,
        vm_id: str,
        agent: AgentClient,
        console: Callable[[], Awaitable[str]] = _no_console,
        raise_if_dead: Callable[[str], None] = _no_qemu,
    ) -> None:
        self.id = vm_id
        self.agent = agent
        self.console = console
        self.seed: int | None = None  # Python's random in it is seeded from this (a fork's)
        self._raise_if_dead = raise_if_dead

    async def _ask(
        self,
        request: wire.Request[A],
        *,
        wait: float = ANSWER_WAIT_SECS,
        payload: bytes | None = None,
    ) -> A:
        """Send ``request`` and return its answer, checked to have its op's shape
        (:class:`AgentError` of kind :data:`MALFORMED` if not: the guest is untrusted)."""
        op = request.op
        return checked(
            op, await self.agent.call(op.name, request.params, wait=wait, payload=payload)
        )

    async def ping(self) -> wire.PingAnswer:
        return await self._ask(wire.PING(None), wait=PING_WAIT_SECS)

    async def exec(
        self,
        argv: list[str],
        *,
        timeout: float = limits.EXEC_TIMEOUT_SECS,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        user: str | None = None,
    ) -> wire.ExecAnswer:
        """Run ``argv`` (as ``user``: default the image's, else root)."""
        params: wire.ExecParams = {
            "argv": argv,
            "cwd": cwd,
            "env": env,
            "stdin": stdin,
            "timeout": timeout,
        }
        if user is not None:
            params["user"] = user
        return await self._ask(wire.EXEC(params), wait=timeout + EXEC_WAIT_MARGIN_SECS)

    async def configure(self, *, env: dict[str, str], cwd: str | None, user: str | None) -> None:
        """Give the agent an image's defaults for every command that does not set its own."""
        await self._ask(wire.CONFIGURE({"env": env, "cwd": cwd, "user": user}))

    async def env_set(
        self, env: dict[str, str], *, cwd: str | None = None, user: str | None = None
    ) -> None:
        """Add ``env`` to the image's environment, for every command started from now;
        ``cwd`` and ``user`` (when given) become their defaults."""
        params: wire.EnvSetParams = {"env": env}
        if cwd is not None:
            params["cwd"] = cwd
        if user is not None:
            params["user"] = user
        await self._ask(wire.ENV_SET(params))

    async def eval(
        self,
        code: str,
        timeout: float = limits.EVAL_TIMEOUT_SECS,
        tag: str | None = None,
        context: str | None = None,
    ) -> wire.EvalAnswer:
        """Run ``code``; the agent interrupts it after ``timeout`` seconds. ``tag`` names
        the eval for :meth:`eval_peek`; ``context`` runs it in an eval context of its own
        (:meth:`eval_context_open`), not the agent's interpreter."""
        params: wire.EvalParams = {"code": code, "timeout_s": timeout}
        if tag is not None:
            params["tag"] = tag
        if context is not None:
            params["context"] = context
        return await self._ask(wire.EVAL(params), wait=eval_wait_secs(timeout))

    async def eval_context_open(self, context: str, language: str, cwd: str | None = None) -> bool:
        """An eval context ``context`` (``python`` or ``javascript``); False if it was."""
        params: wire.EvalContextOpenParams = {"context": context, "language": language}
        if cwd is not None:
            params["cwd"] = cwd
        return (await self._ask(wire.EVAL_CONTEXT_OPEN(params), wait=PING_WAIT_SECS))["created"]

    async def eval_context_close(self, context: str) -> bool:
        """End the eval context ``context`` and its state; False if there was none."""
        asked: wire.EvalContextCloseParams = {"context": context}
        return (await self._ask(wire.EVAL_CONTEXT_CLOSE(asked), wait=PING_WAIT_SECS))["closed"]

    async def eval_peek(self, tag: str, stdout_from: int, stderr_from: int) -> wire.EvalPeekAnswer:
        """What the running eval ``tag`` printed past those offsets (not running: none)."""
        asked: wire.EvalPeekParams = {
            "tag": tag,
            "stdout_from": stdout_from,
            "stderr_from": stderr_from,
        }
        return await self._ask(wire.EVAL_PEEK(asked), wait=PING_WAIT_SECS)

    async def eval_interrupt(self, context: str | None = None) -> bool:
        """KeyboardInterrupt in the running eval (of ``context``); False if none ran."""
        params: wire.EvalInterruptParams | None = None if context is None else {"context": context}
        return (await self._ask(wire.EVAL_INTERRUPT(params), wait=PING_WAIT_SECS))["interrupted"]

    async def read_file(self, path: str) -> bytes:
        result = await self._ask(wire.FILE_READ({"path": path}))
        return base64.b64decode(result["data"])

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        params: wire.FileWriteParams = {
            "path": path,
            "data": base64.b64encode(data).decode(),
            "mode": mode,
        }
        return (await self._ask(wire.FILE_WRITE(params)))["size"]

    async def list_dir(self, path: str) -> list[wire.FileListEntry]:
        return listed(await self._ask(wire.FILE_LIST({"path": path})))

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._ask(wire.FILE_REMOVE({"path": path, "recursive": recursive}))

    # An entry as E2B's envd describes one, and change notifications (forkd_entries.py,
    # forkd_watch.py); ``user``: whose home a relative path is in, who owns new dirs.

    async def fs_stat(self, path: str, user: str | None = None) -> entries.FsEntry:
        asked: entries.EntryParams = {"path": path}
        if user is not None:
            asked["user"] = user
        return await self._ask(entries.FS_STAT(asked))

    async def fs_list(self, path: str, depth: int, user: str | None = None) -> entries.FsListAnswer:
        asked: entries.FsListParams = {"path": path, "depth": depth}
        if user is not None:
            asked["user"] = user
        answer = await self._ask(entries.FS_LIST(asked))
        bounded("fs_list", len(answer["entries"]), wire.MAX_LIST_ENTRIES)
        return answer

    async def fs_mkdir(self, path: str, user: str | None = None) -> entries.FsMkdirAnswer:
        asked: entries.EntryParams = {"path": path}
        if user is not None:
            asked["user"] = user
        return await self._ask(entries.FS_MKDIR(asked))

    async def fs_move(
        self, source: str, destination: str, user: str | None = None
    ) -> entries.FsEntry:
        asked: entries.FsMoveParams = {"source": source, "destination": destination}
        if user is not None:
            asked["user"] = user
        return await self._ask(entries.FS_MOVE(asked))

    async def watch_open(self, path: str, recursive: bool) -> str:
        opened = await self._ask(entries.WATCH_OPEN({"path": path, "recursive": recursive}))
        return opened["watch_id"]

    async def watch_read(
        self, watch_id: str, wait_s: float, max_events: int = 1000
    ) -> entries.WatchReadAnswer:
        asked = entries.WATCH_READ(
            {"watch_id": watch_id, "wait_s": wait_s, "max_events": max_events}
        )
        answer = await self._ask(asked, wait=wait_s + ANSWER_WAIT_SECS)
        bounded("fs_watch_read", len(answer["events"]), max_events)
        return answer

    async def watch_close(self, watch_id: str) -> bool:
        return (await self._ask(entries.WATCH_CLOSE({"watch_id": watch_id})))["closed"]

    # Chunked transfers (docs/guest-agent.md, "Chunked transfers"): the agent keeps
    # each open upload or tar stream under an id until it is finished or idle.

    async def upload_open(
        self, path: str, first: bytes, *, tar: bool = False, commit: bool = False
    ) -> wire.UploadOpenAnswer:
        """Open an upload with its first chunk: ``{"transfer_id", "size"}``; with
        ``commit``, the whole file written at once: ``{"path", "size"}``."""
        params: wire.UploadOpenParams = {
            "path": path,
            "format": "tar" if tar else "file",
            "commit": commit,
            "data": base64.b64encode(first).decode(),
        }
        return await self._ask(wire.UPLOAD_OPEN(params), wait=OPEN_WAIT_SECS)

    async def upload_write(
        self, transfer_id: str, offset: int, data: bytes, *, payload: bool = False
    ) -> int:
        """Append ``data`` at ``offset``; with ``payload`` (the open's answer said the
        agent reads them), the bytes go raw after the request's line, not as base64."""
        params: wire.UploadWriteParams = {"transfer_id": transfer_id, "offset": offset}
        if not payload:
            params["data"] = base64.b64encode(data).decode()
        result = await self._ask(wire.UPLOAD_WRITE(params), payload=data if payload else None)
        return result["size"]

    async def upload_commit(self, transfer_id: str) -> int:
        params: wire.TransferParams = {"transfer_id": transfer_id}
        return (await self._ask(wire.UPLOAD_COMMIT(params), wait=COMMIT_WAIT_SECS))["size"]

    async def transfer_abort(self, transfer_id: str) -> None:
        await self._ask(wire.TRANSFER_ABORT({"transfer_id": transfer_id}))

    async def read_range(
        self, path: str, offset: int, length: int
    ) -> tuple[bytes, int | None, bool]:
        """Up to ``length`` bytes at ``offset``, the file's size (None: unknown), and
        whether they reach its end."""
        params: wire.ReadRangeParams = {
            "path": path,
            "offset": offset,
            "length": length,
            "raw": True,
        }
        result = await self._ask(wire.READ_RANGE(params))
        return data_of(result, length), result.get("size"), result["eof"]

    async def tar_open(self, path: str) -> str:
        return (await self._ask(wire.TAR_OPEN({"path": path})))["transfer_id"]

    async def tar_open_paths(self, paths: list[str]) -> str:
        """A tar stream of the files at ``paths`` (members named by their paths)."""
        return (await self._ask(wire.TAR_OPEN({"paths": paths})))["transfer_id"]

    async def fs_manifest_open(self, path: str, max_entries: int) -> wire.ManifestAnswer:
        """``{"transfer_id", "lower"}``: the manifest of what the sandbox changed under
        ``path`` (its overlay's upper layer), read with :meth:`tar_read`."""
        params: wire.ManifestParams = {"path": path, "max_entries": max_entries}
        return await self._ask(wire.MANIFEST_OPEN(params), wait=OPEN_WAIT_SECS)

    async def fs_lower_stat(self, paths: list[str]) -> list[wire.LowerStat | None]:
        """What the image holds at each of ``paths`` (the agent's fields, or None)."""
        return (await self._ask(wire.LOWER_STAT({"paths": paths})))["stats"]

    async def tar_read(self, transfer_id: str, length: int) -> tuple[bytes, bool]:
        params: wire.TarReadParams = {"transfer_id": transfer_id, "length": length, "raw": True}
        result = await self._ask(wire.TAR_READ(params), wait=COMMIT_WAIT_SECS)
        return data_of(result, length), result["eof"]

    # Background processes (docs/guest-agent.md, "Processes"): the agent owns them;
    # these return its ProcessInfo and proc_read answers as they are.

    async def proc_start(
        self,
        cmd: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bool = False,
        pty: wire.PtySize | None = None,
        timeout_s: float | None = None,
        user: str | None = None,
    ) -> wire.ProcInfo:
        params: wire.ProcStartParams = {
            "cmd": cmd,
            "env": env,
            "cwd": cwd,
            "stdin": stdin,
            "pty": pty,
            "timeout_s": timeout_s,
        }
        if user is not None:
            params["user"] = user
        return await self._ask(wire.PROC_START(params))

    async def stats(self, paths: list[str]) -> wire.StatsAnswer:
        """What the guest uses (CPU, memory, disk, network, processes), and the space of
        each mount point in ``paths`` (forkd_stats.py). The guest's word: check it."""
        return await self._ask(wire.STATS({"paths": paths}))

    async def proc_list(self) -> list[wire.ProcInfo]:
        """The guest's processes."""
        return (await self._ask(wire.PROC_LIST(None)))["processes"]

    async def proc_info(self, pid: int) -> wire.ProcInfo:
        return await self._ask(wire.PROC_INFO({"pid": pid}))

    async def proc_read(
        self,
        pid: int,
        offset: int,
        *,
        wait_s: float = 0.0,
        max_bytes: int = PROC_READ_MAX_BYTES,
        min_bytes: int = 1,
        linger_s: float = 0.0,
    ) -> wire.ProcReadAnswer:
        """Output after ``offset``, waiting up to ``wait_s`` for some, then up to
        ``linger_s`` more for ``min_bytes`` in all. The bytes come raw after the
        answer (``raw``; chunks give their ``size``), or, from an agent older than
        that, as base64 in each chunk's ``data``."""
        params: wire.ProcReadParams = {
            "pid": pid,
            "offset": offset,
            "wait_s": wait_s,
            "max_bytes": max_bytes,
            "min_bytes": min_bytes,
            "linger_s": linger_s,
            "raw": True,
        }
        wait = wait_s + linger_s + EXEC_WAIT_MARGIN_SECS
        return await self._ask(wire.PROC_READ(params), wait=wait)

    async def proc_stdin(self, pid: int, data: bytes, eof: bool = False) -> int:
        """Write ``data`` to the process's stdin, in pieces the agent accepts; bytes written."""
        step = wire.MAX_PROC_STDIN_BYTES
        pieces = [data[i : i + step] for i in range(0, len(data), step)] or [b""]
        written = 0
        for i, piece in enumerate(pieces):
            params: wire.ProcStdinParams = {
                "pid": pid,
                "data": base64.b64encode(piece).decode(),
                "eof": eof and i == len(pieces) - 1,
            }
            written += (await self._ask(wire.PROC_STDIN(params)))["written"]
        return written

    async def proc_signal(self, pid: int, signal: int | str) -> None:
        await self._ask(wire.PROC_SIGNAL({"pid": pid, "signal": signal}))

    async def proc_resize(self, pid: int, cols: int, rows: int) -> None:
        await self._ask(wire.PROC_RESIZE({"pid": pid, "cols": cols, "rows": rows}))

    async def wait_ready(self, timeout: float) -> None:
        """Until the agent of a booting VM answers; :class:`VMError` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_dead("QEMU exited during boot")
            try:
                await self._ask(wire.PING(None), wait=2.0)
                return
            except AgentError as exc:
                if time.monotonic() > deadline:
                    raise VMError(
                        f"the guest agent did not answer within {timeout:g} s ({exc}). "
                        f"Console: {await self.console()}"
                    ) from exc
            await asyncio.sleep(PING_RETRY_SECS)

    async def after_resume(self, timeout: float = PING_WAIT_SECS) -> None:
        """After ``cont`` of a paused VM: once its agent answers, set the guest's clock,
        which stood still while paused, and reseed its RNGs; the hostname stays."""
        await self.wait_ready(timeout)
        # A seeded sandbox's random goes on where it was: a pause clones nothing.
        await self.make_unique(self.id, timeout, keep_random=self.seed is not None)

    async def reseed(
        self, hostname: str, timeout: float, snapshot_dir: Path, memory: Path, seed: int | None
    ) -> None:
        """After a restore from ``snapshot_dir``: :meth:`make_unique`, a guest that does
        not answer being a damaged snapshot's (its ``memory``: :class:`SnapshotError`);
        what the guest could not do beyond reseeding its RNGs is logged."""
        try:
            result = await self.make_unique(hostname, timeout, seed=seed)
            self.seed = seed
        except AgentError as exc:
            self._raise_if_dead(f"the guest restored from {memory} died")
            raise SnapshotError(
                f"the guest restored from {memory} does not answer ({exc}); "
                f"memory.bin or vmstate may be corrupt. Console: {await self.console()}"
            ) from exc
        errors = check_reseeded(result, self.id, snapshot_dir)
        if errors:
            log.warning("restore of %s: %s", self.id, errors)

    async def make_unique(
        self, hostname: str, wait: float, *, seed: int | None = None, keep_random: bool = False
    ) -> wire.RestoreAnswer:
        """After a restore: the wall-clock time, fresh entropy and a new hostname; Python's
        random seeded from ``seed`` when given (:class:`SnapshotError` from an agent too
        old to), else from the fresh entropy unless ``keep_random``."""
        params: wire.RestoreParams = {
            "time_ns": time.time_ns(),
            "entropy": base64.b64encode(os.urandom(RESTORE_ENTROPY_BYTES)).decode(),
            "hostname": hostname,
        }
        if seed is not None:
            params["seed"] = seed
        if keep_random:
            params["keep_random"] = True
        result = await self._ask(wire.RESTORE(params), wait=wait)
        if seed is not None and result.get("seeded") is not True:
            raise SnapshotError(
                f"the guest agent of {self.id} did not take seed {seed} ({result}): its "
                "snapshot predates seeds, so rebuild the template to fork it with one"
            )
        return result


def check_reseeded(result: wire.RestoreAnswer, vm_id: str, snapshot_dir: Path) -> str:
    """The agent's answer to ``restore``: :class:`SnapshotError` unless both RNGs were
    reseeded; else what else failed (clock, hostname), to be logged, or ``""``."""
    kept = result.get("errors", [])[:RESTORE_ERRORS_KEPT]
    errors = "; ".join(e[:RESTORE_ERROR_CHARS] for e in kept)
    # Children of one snapshot share its RNG state: a child the agent could
    # not reseed would hand out its siblings' keys, tokens and temp names.
    # The clock and the hostname are only logged: neither is a secret.
    steps = {"rng_reseeded": "kernel RNG", "random_reseeded": "Python random"}
    unseeded = [name for key, name in steps.items() if result.get(key) is not True]
    if unseeded:
        raise SnapshotError(
            f"fork {vm_id} refused: the guest restored from {snapshot_dir} could not reseed "
            f"its {' and '.join(unseeded)} ({errors or 'no reason given'}), so it would "
            "share random numbers with every other child of the snapshot"
        )
    return errors
