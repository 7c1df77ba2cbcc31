"""An E2B template's build steps, run on the VM that becomes the template: RUN, COPY
(the files its SDK uploaded, extracted by the guest agent's own tar extractor), ENV,
WORKDIR and USER, then its start command, waited for until its ready command exits 0.

Every step runs inside the guest, through the agent: a step's text is never a host
command, and a COPY's archive is unpacked in the guest, never on the host. ENV,
WORKDIR and USER become the defaults of every command in the template's sandboxes, as
an image's own do (the agent's ``env_set``).
"""

from __future__ import annotations

import asyncio
import posixpath
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TypeVar

from forkd import limits
from forkd.controller.e2b.build_models import BuildStep
from forkd.controller.e2b.builds import Build
from forkd.controller.e2b.gzip_body import inflated
from forkd.controller.e2b.models import bad_env_name
from forkd.controller.models import SnapshotCreate
from forkd.controller.services import template_start
from forkd.controller.services.file_transfer import FileTransferService
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.errors import AgentError, ForkdError, Invalid

T = TypeVar("T")
STAGE = "/tmp/.forkd-e2b-copy"  # a COPY's files are extracted here in the guest, then moved
READ_PIECE = 1 << 20  # of an uploaded archive, read at a time
MODE = re.compile(r"^[0-7]{3,4}$")
LOG_LINES = 200  # of one step's output, in the build's log (its last ones)
TAIL_CHARS = 1500  # of a failed step's output, in its error
GZIP_MAGIC = b"\x1f\x8b"
MAX_STEPS = 500

# A COPY in the guest, Docker's way: a directory's content goes into the destination; a
# file goes to the destination, or into it when it is a directory, ends with "/" or
# several sources match. $1 the stage, $2 the source (a glob, relative to the build's
# files), $3 the destination (relative: to the working directory), $4 owner, $5 mode.
COPY_SCRIPT = r"""
set -eu
stage=$1 src=$2 dest=$3 owner=$4 mode=$5
trap 'rm -rf "$stage"' EXIT
case $dest in /*) ;; *) dest="$PWD/$dest" ;; esac
cd "$stage"
IFS=''
set -- $src
if [ "$#" -eq 1 ] && [ ! -e "$1" ] && [ ! -L "$1" ]; then
    echo "COPY: no file matches $src" >&2
    exit 1
fi
into=0
case $dest in */) into=1 ;; esac
if [ "$#" -gt 1 ] || [ -d "$dest" ]; then into=1; fi
place() {
    if [ -d "$1" ] && [ ! -L "$1" ]; then
        mkdir -p "$2"
        cp -a "$1"/. "$2"/
    else
        mkdir -p "$(dirname "$2")"
        cp -a "$1" "$2"
    fi
    if [ -n "$owner" ]; then chown -R "$owner" "$2"; fi
    if [ -n "$mode" ]; then chmod "$mode" "$2"; fi
}
for item in "$@"; do
    if [ "$into" = 0 ] || { [ -d "$item" ] && [ ! -L "$item" ]; }; then
        place "$item" "$dest"
    else
        mkdir -p "$dest"
        place "$item" "${dest%/}/$(basename "$item")"
    fi
done
"""


class StepFailed(ForkdError):
    """A build step failed: ``step`` is E2B's name for it (its number, ``base`` or
    ``finalize``), which its SDK points the user's stack trace at."""

    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.step = step


class _OneVM:
    """The daemon's file transfers, run on one VM (the template being built)."""

    def __init__(self, vm: SandboxVM) -> None:
        self.vm = vm

    async def call(
        self,
        sandbox_id: str,
        call: Callable[[SandboxVM], Awaitable[T]],
        refusals: Mapping[str, type[ForkdError]] | None = None,
        wake: bool = True,
    ) -> T:
        try:
            return await call(self.vm)
        except AgentError as exc:
            refusal = (refusals or {}).get(exc.kind or "")
            if refusal is not None:
                raise refusal(str(exc)) from exc
            raise


async def _archive(path: Path, limit: int) -> AsyncIterator[bytes]:
    """An uploaded archive as a plain tar (gunzipped when it is gzip, as the SDK sends it
    by default), at most ``limit`` bytes inflated."""

    async def raw() -> AsyncIterator[bytes]:
        with path.open("rb") as f:
            while piece := f.read(READ_PIECE):
                yield piece

    with path.open("rb") as f:
        gzipped = f.read(2) == GZIP_MAGIC
    chunks = inflated(raw(), limit) if gzipped else raw()
    async for chunk in chunks:
        yield chunk


class StepRunner:
    """The steps of ``build`` on ``vm``, each logged to the build as it goes."""

    def __init__(self, vm: SandboxVM, build: Build, inflate_limit: int) -> None:
        self.vm = vm
        self.build = build
        self.inflate_limit = inflate_limit
        self.user: str | None = None  # set by a USER step: the owner of later COPYs

    async def run(
        self, steps: list[BuildStep], start_cmd: str | None, ready_cmd: str | None
    ) -> None:
        handlers = {
            "RUN": self._run,
            "COPY": self._copy,
            "ENV": self._env,
            "WORKDIR": self._workdir,
            "USER": self._user,
        }
        for number, step in enumerate(steps, 1):
            label = str(number)
            self.build.log(f"[{number}/{len(steps)}] {step.type} {' '.join(step.args)}", step=label)
            handler = handlers.get(step.type)
            if handler is None:
                raise StepFailed(f"step type {step.type!r} is not one forkd builds", label)
            try:
                await handler(step, number)
            except StepFailed:
                raise
            except ForkdError as exc:
                raise StepFailed(f"{step.type} failed: {exc}", label) from exc
        if start_cmd or ready_cmd:
            await self._start(start_cmd, ready_cmd)

    async def _exec(
        self, argv: list[str], step: str, user: str | None = None, timeout: float | None = None
    ) -> None:
        res = await self.vm.guest.exec(
            argv, timeout=timeout or limits.SETUP_TIMEOUT_SECS, user=user
        )
        output = (res["stdout"] + res["stderr"]).splitlines()
        for line in output[-LOG_LINES:]:
            self.build.log(line, step=step)
        if res["exit_code"] != 0:
            tail = "\n".join(output[-20:])[-TAIL_CHARS:]
            raise StepFailed(f"exited {res['exit_code']}: {tail}".rstrip(": "), step)

    async def _run(self, step: BuildStep, number: int) -> None:
        command, user = step.arg(0), step.arg(1)
        if not command:
            raise StepFailed("RUN without a command", str(number))
        await self._exec(["/bin/sh", "-c", command], str(number), user or None)

    async def _copy(self, step: BuildStep, number: int) -> None:
        src, dest, owner, mode = (step.arg(i) for i in range(4))
        label = str(number)
        if not src or not dest:
            raise StepFailed("COPY needs a source and a destination", label)
        if src.startswith("/") or ".." in src.split("/"):
            raise StepFailed(f"COPY source {src!r} must be relative, inside the files", label)
        if mode and not MODE.fullmatch(mode):
            raise StepFailed(f"COPY mode {mode!r} is not an octal mode", label)
        archive = self.build.files.get(step.files_hash or "")
        if archive is None:
            raise StepFailed("COPY's files were not uploaded (filesHash unknown)", label)
        stage = f"{STAGE}-{number}"
        files = FileTransferService(_OneVM(self.vm))
        await files.upload(self.vm.id, stage, _archive(archive, self.inflate_limit), tar=True)
        argv = ["/bin/sh", "-c", COPY_SCRIPT, "forkd-copy", stage, src, dest]
        await self._exec([*argv, owner or self.user or "", mode], label, "root")

    async def _env(self, step: BuildStep, number: int) -> None:
        args = step.args
        if len(args) % 2:
            raise StepFailed("ENV takes names and values in pairs", str(number))
        env = dict(zip(args[::2], args[1::2], strict=True))
        bad = [k for k, v in env.items() if bad_env_name(k) or "\0" in v]
        if bad:
            raise StepFailed(f"ENV: {bad[0]!r} is not a variable name", str(number))
        await self.vm.guest.env_set(env)

    async def _workdir(self, step: BuildStep, number: int) -> None:
        path = step.arg(0)
        if not path or "\0" in path:
            raise StepFailed("WORKDIR needs a path", str(number))
        if not path.startswith("/"):
            here = await self.vm.guest.exec(["pwd"], timeout=30)
            path = posixpath.join(here["stdout"].strip() or "/", path)
        path = posixpath.normpath(path)
        await self._exec(["mkdir", "-p", "--", path], str(number), "root")
        await self.vm.guest.env_set({}, cwd=path)

    async def _user(self, step: BuildStep, number: int) -> None:
        user = step.arg(0)
        if not user:
            raise StepFailed("USER needs a user", str(number))
        await self._exec(["id", "-u", "--", user], str(number), "root")
        await self.vm.guest.env_set({}, user=user)
        self.user = user

    async def _start(self, start_cmd: str | None, ready_cmd: str | None) -> None:
        """The start command run in the background until the ready command exits 0
        (E2B's ``set_start_cmd``): every sandbox of the template has it running."""
        ready = ["/bin/sh", "-c", ready_cmd] if ready_cmd else None
        self.build.log(f"start {start_cmd!r}, ready when {ready_cmd!r} exits 0", step="finalize")
        if not start_cmd and ready is not None:
            await self._await_ready(ready)
            return
        req = SnapshotCreate(tag=self.build.name, start=True, ready_cmd=ready)

        def report(message: str, output: str) -> None:
            self.build.log(f"{message}{': ' + output if output else ''}", step="finalize")

        try:
            await template_start.run_until_ready(
                self.vm, ["/bin/sh", "-c", start_cmd or ""], req, report, what="the start command"
            )
        except ForkdError as exc:
            raise StepFailed(str(exc), "finalize") from exc

    async def _await_ready(self, ready: list[str]) -> None:
        """A ready command without a start command: run until it exits 0."""
        deadline = time.monotonic() + limits.READY_TIMEOUT_SECS
        while True:
            res = await self.vm.guest.exec(ready, timeout=template_start.READY_CMD_TIMEOUT_SECS)
            if res["exit_code"] == 0:
                return
            if time.monotonic() >= deadline:
                raise StepFailed(
                    f"the ready command did not exit 0 within {limits.READY_TIMEOUT_SECS:g} s "
                    f"(last: {res['exit_code']})",
                    "finalize",
                )
            await asyncio.sleep(template_start.POLL_SECS)


def check_steps(steps: list[BuildStep]) -> None:
    """Refuse, before anything boots, a build forkd cannot run."""
    if len(steps) > MAX_STEPS:
        raise Invalid(f"a build has at most {MAX_STEPS} steps")
    for step in steps:
        if step.type not in ("RUN", "COPY", "ENV", "WORKDIR", "USER"):
            raise Invalid(f"step type {step.type!r} is not one forkd builds")
