"""A template before its snapshot: the image's defaults given to the agent, its setup
commands and warm-ups run, and (``start``) the image's service started and waited for
until it is ready.

Every fork restores the template's memory, so a service started here runs,
warm, in each fork from its first instruction: that is the point of ``start``.
Readiness is a guest TCP port that listens (read from the guest's
``/proc/net/tcp`` and ``tcp6`` through the agent, so the image needs no tool of
its own) or a command that exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from forkd import limits
from forkd.controller.models import SnapshotCreate
from forkd.controller.services import egress_trust
from forkd.controller.services.process_output import ReadAnswer
from forkd.controller.services.sandbox_vm import SandboxGuest, SandboxVM
from forkd.errors import AgentError, Conflict, GuestError, Invalid, VMError
from forkd.guest import container_image
from forkd.guest import image as images
from forkd.vmm.agent.ops import EVAL_IMAGE_REFUSALS

log = logging.getLogger(__name__)
POLL_SECS = 0.5
READY_CMD_TIMEOUT_SECS = 30.0  # one run of ready_cmd
OUTPUT_TAIL_BYTES = 2000  # of the service's output, in the error when it is not ready
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp for LISTEN
# Read of each socket table: ~6,800 sockets of /proc/net/tcp (150 bytes a line), more than
# a template starting its service has; a listening socket past them goes unseen.
SOCKET_TABLE_BYTES = 1 << 20


class TemplateSetupFailed(VMError):
    """A template's setup command, warm-up or started service failed (500)."""


def check(req: SnapshotCreate) -> None:
    """Refuse, before anything is fetched or booted, what ``start`` cannot mean."""
    if not req.start and (req.ready_port is not None or req.ready_cmd is not None):
        raise Invalid("ready_port and ready_cmd need start: true")


def _env(config_env: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for item in config_env:
        name, sep, value = item.partition("=")
        if sep and name:
            env[name] = value
    return env


async def configure(
    template: SandboxVM, img: images.Image, req: SnapshotCreate, ca_pem: bytes | None = None
) -> None:
    """Give the agent the image's environment, working directory and user; with
    ``ca_pem`` (the egress proxy's CA), put it in the guest's trust stores first and
    name it in the environment (under the image's own variables)."""
    env: dict[str, str] = {}
    cwd = user = None
    if container_image.is_container(img):
        config = container_image.config_of(img)
        env, cwd, user = _env(config.env), config.working_dir or None, config.user or None
    env.update(req.env or {})
    if ca_pem is not None:
        env = {**await egress_trust.install(template.guest, ca_pem, req.tag), **env}
    if env or cwd or user:
        await template.guest.configure(env=env, cwd=cwd, user=user)


async def run_setup(template: SandboxVM, setup: list[str], warmups: list[str]) -> None:
    """A template's setup commands, then its warm-ups (each an eval), in order."""
    for cmd in setup:
        res = await template.guest.exec(["/bin/sh", "-c", cmd], timeout=limits.SETUP_TIMEOUT_SECS)
        if res["exit_code"] != 0:
            tail = (res["stderr"] or res["stdout"]).strip()[-1500:]
            raise TemplateSetupFailed(f"setup command {cmd!r} exited {res['exit_code']}: {tail}")
    for warmup in warmups:
        try:
            evaluated = await template.guest.eval(warmup, timeout=limits.SETUP_TIMEOUT_SECS)
        except AgentError as exc:
            if exc.kind in EVAL_IMAGE_REFUSALS:  # the image cannot run it: 409
                raise Conflict(f"warmup cannot run: {exc}") from exc
            raise
        error = evaluated.get("error")
        if error:
            raise TemplateSetupFailed(f"warmup failed:\n{error}")


def readiness(req: SnapshotCreate, exposed: tuple[str, ...]) -> tuple[int | None, str]:
    """The port ``start`` waits for (``ready_port``, else the image's one exposed TCP
    port, else none) and what the answer says of it."""
    if req.ready_port is not None:
        return req.ready_port, f"waited for port {req.ready_port} to listen"
    if req.ready_cmd is not None:
        return None, f"waited for {req.ready_cmd!r} to exit 0"
    tcp = sorted(
        {
            port
            for port, proto in map(_port_and_protocol, exposed)
            if port is not None and proto == "tcp"
        }
    )
    if len(tcp) == 1:
        return tcp[0], (
            f"waited for port {tcp[0]} to listen (the image's one exposed port; "
            "ready_port or ready_cmd says otherwise)"
        )
    which = f"it exposes {', '.join(map(str, tcp))}" if tcp else "it exposes no port"
    return None, (
        f"waited for nothing: {which}; the snapshot was taken once the command "
        "had started. Give ready_port (--ready-port) or ready_cmd (--ready-cmd) "
        "to snapshot it ready"
    )


def _port_and_protocol(exposed: str) -> tuple[int | None, str]:
    """``8080/tcp`` (or ``8080``: tcp) as (8080, "tcp"); (None, ...) for what is not."""
    port, _, proto = exposed.partition("/")
    number = int(port) if port.isdigit() and 0 < int(port) < 65536 else None
    return number, (proto or "tcp").lower()


# (message, the command's last output line): what a template's start is doing now.
Report = Callable[[str, str], None]
REPORT_EVERY_SECS = 2.0


async def start(
    template: SandboxVM, img: images.Image, req: SnapshotCreate, report: Report | None = None
) -> str | None:
    """Run the image's Entrypoint+Cmd in the background and wait until it is ready; what
    was waited for (None without ``start``). ``report`` hears what is waited for, and the
    command's latest output, every :data:`REPORT_EVERY_SECS` while it waits."""
    if not req.start:
        return None
    config = container_image.config_of(img)
    argv = [*config.entrypoint, *config.cmd]
    if not argv:
        raise Invalid(f"image {img.name} has no Entrypoint or Cmd to start")
    port, said = readiness(req, config.exposed_ports)
    if port != req.ready_port:
        req = req.model_copy(update={"ready_port": port})
    await run_until_ready(template, argv, req, report, what="the image's command")
    return said


async def run_until_ready(
    template: SandboxVM,
    argv: list[str],
    req: SnapshotCreate,
    report: Report | None = None,
    *,
    what: str = "the command",
) -> None:
    """Start ``argv`` in the background and wait until ``req``'s ``ready_port`` listens
    and its ``ready_cmd`` exits 0 (with neither: until it is seen running), within
    ``req.ready_timeout_secs``; :class:`TemplateSetupFailed` when it exits first or is
    not ready in time, with its last output."""
    proc = await template.guest.proc_start(argv)
    pid = int(proc["pid"])
    began = time.monotonic()
    deadline = began + req.ready_timeout_secs
    port = req.ready_port
    waiting = (
        f"port {port} to listen"
        if port is not None
        else f"{req.ready_cmd!r} to exit 0"
        if req.ready_cmd is not None
        else "nothing"
    )
    reported = 0.0
    while True:
        now = time.monotonic()
        if report is not None and now - reported >= REPORT_EVERY_SECS:
            reported = now
            tail = await _output_tail(template, pid)
            last = tail.splitlines()[-1] if tail.strip() and tail != "(none)" else ""
            report(
                f"started {argv[0]}; waiting for {waiting} ({now - began:.0f} s of "
                f"{req.ready_timeout_secs:g}, --ready-timeout)",
                last,
            )
        info = await template.guest.proc_info(pid)
        if not info["running"]:
            tail = await _output_tail(template, pid)
            raise TemplateSetupFailed(
                f"{what} {argv!r} exited {info['exit_code']} before it was "
                f"ready; its last output:\n{tail}"
            )
        if await _ready(template, req):
            return
        if time.monotonic() >= deadline:
            raise _not_ready(argv, req, await _output_tail(template, pid), what)
        await asyncio.sleep(POLL_SECS)


async def _ready(template: SandboxVM, req: SnapshotCreate) -> bool:
    if req.ready_port is not None and not await listening(template.guest, req.ready_port):
        return False
    if req.ready_cmd is not None:
        res = await template.guest.exec(req.ready_cmd, timeout=READY_CMD_TIMEOUT_SECS)
        return bool(res["exit_code"] == 0)
    return True


def _not_ready(argv: list[str], req: SnapshotCreate, tail: str, who: str) -> TemplateSetupFailed:
    """The image's command ran past its readiness deadline: what was not ready, and its
    last output."""
    what = (
        f"port {req.ready_port} did not listen"
        if req.ready_port is not None
        else f"{req.ready_cmd!r} did not exit 0"
        if req.ready_cmd is not None
        else "it did not stay up"
    )
    return TemplateSetupFailed(
        f"{who} {argv!r} was not ready within "
        f"{req.ready_timeout_secs:g} s ({what}; ready_timeout_secs, --ready-timeout, "
        f"waits longer: default {limits.READY_TIMEOUT_SECS:g} s); its last "
        f"output:\n{tail}"
    )


async def listening(guest: SandboxGuest, port: int) -> bool:
    """Whether a TCP socket in the guest listens on ``port`` (any address), from the
    first :data:`SOCKET_TABLE_BYTES` of each socket table (asked every half second:
    a guest with a huge table must not have the daemon read and split it each time)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            data, _, _ = await guest.read_range(table, 0, SOCKET_TABLE_BYTES)
        except (AgentError, GuestError):
            continue  # no IPv6 in the guest: no tcp6
        for line in data.decode("ascii", "replace").splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == TCP_LISTEN:
                _, _, hex_port = fields[1].rpartition(":")
                if hex_port.upper() == f"{port:04X}":  # the kernel's %04X
                    return True
    return False


async def _output_tail(template: SandboxVM, pid: int) -> str:
    """The last :data:`OUTPUT_TAIL_BYTES` of a background process's output, as text."""
    try:
        info = await template.guest.proc_info(pid)
        end = int(info["output_end"])
        offset = max(int(info["output_start"]), end - OUTPUT_TAIL_BYTES)
        answer = ReadAnswer.parse(await template.guest.proc_read(pid, offset), offset)
    except (AgentError, GuestError, KeyError, TypeError, ValueError) as exc:
        return f"(its output could not be read: {exc})"
    data = b"".join(chunk.data for chunk in answer.chunks)
    return data.decode("utf-8", "replace").strip() or "(none)"
