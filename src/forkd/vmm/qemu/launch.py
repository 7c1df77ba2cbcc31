"""Starting a QEMU process in a fresh run directory of its own.

The directory holds the process's sockets and logs (:class:`RuntimePaths`);
:func:`tail` reads the end of those logs back for error messages. What
confines the process is decided here: its cgroup, its network namespace, its
seccomp filter, the uid it drops to and the capabilities it keeps until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from forkd import hosttools
from forkd.errors import ForkdError, VMError
from forkd.vmm.jail import cgroups, network, qemu_user
from forkd.vmm.jail.egress import Egress
from forkd.vmm.qemu.argv import QEMU_BINARY, SANDBOX, MachineConfig, RuntimePaths, build_argv
from forkd.vmm.volumes.disks import Attachment
from forkd.vmm.volumes.shares import Share

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107
# The gate a QEMU waits at until the daemon has moved it into its cgroup: read a
# line from stdin (a pipe), then become the rest of the command line. Nothing
# is interpreted: the command is passed as the script's positional parameters.
CGROUP_GATE = 'read -r _ && exec "$@" </dev/null'
# A QEMU that drops to its uid starts as root holding only the two
# capabilities -runas spends on the drop, under no_new_privs and with an empty
# bounding set: once dropped it holds none and can gain none. At exec, root's
# permitted set is its bounding set and its inheritable set together, so with
# the bounding set empty the two must be inheritable; and setpriv empties the
# bounding set before it sets inheritable ones, so it takes two setprivs.
RUNAS_CAPS = "-all,+setuid,+setgid"


@dataclasses.dataclass(frozen=True)
class Launched:
    """A started QEMU and what it was given, each undone once it is gone."""

    proc: subprocess.Popen[bytes]
    net: network.SandboxNet | None
    cgroup: cgroups.Group | None
    uid: qemu_user.Lease | None  # the uid it drops to; None: it keeps the daemon's


def prepare_runtime(run_root: Path, vm_id: str) -> RuntimePaths:
    """Create ``<run_root>/<vm_id>``, which must not exist yet."""
    rt = RuntimePaths(run_root / vm_id)
    if len(str(rt.agent)) > UNIX_PATH_MAX:
        raise VMError(f"run directory {rt.dir} is too long for unix sockets")
    rt.dir.mkdir(mode=0o700, parents=True, exist_ok=False)  # sockets, logs, guest RAM
    rt.empty_share.mkdir(mode=0o755)  # QEMU holds it open: it needs no way in by name
    return rt


def spawn(
    argv: list[str],
    rt: RuntimePaths,
    detach: bool,
    netns: str | None = None,
    cgroup: cgroups.Group | None = None,
    pass_fds: Sequence[int] = (),
    uid: qemu_user.Lease | None = None,
    umask: int = -1,
) -> subprocess.Popen[bytes]:
    """Start QEMU with its output in ``qemu.log``; on failure no process is left (the
    run directory is the caller's).

    ``detach``: in a session of its own, to outlive this process (a daemon's
    sandboxes); otherwise killed when this process dies. ``netns``: the
    network namespace (under /run/netns) QEMU starts in. ``cgroup``: the
    group QEMU joins before it runs (so before any guest code does, and
    before QEMU allocates anything). ``uid``: the uid ``argv`` drops to
    (``-runas``), handed to the process as soon as it exists; QEMU then keeps
    only the capabilities the drop needs (:data:`RUNAS_CAPS`).

    No Python runs between fork and exec, so ``subprocess`` can use vfork: a
    ``preexec_fn`` makes it copy the whole daemon instead, 10 ms and more for a
    daemon holding many VMs, on its event loop. What such a function did is
    done by small programs the command runs through instead: ``sh`` waits at a
    gate until this process has written its pid into the cgroup,
    ``nsenter`` enters the namespace, ``setpriv`` sets the parent-death signal
    and the capabilities.
    """
    gate_r = gate_w = -1
    try:
        hosttools.require(QEMU_BINARY)
        command = _wrapped(argv, detach, netns, cgroup, drop=uid is not None)
        if cgroup is not None:
            gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
        proc = _popen(command, rt, gate_r, pass_fds, detach, umask)
    except BaseException:
        _close_fds(gate_r, gate_w)
        raise
    _close_fds(gate_r)
    try:
        _hand_over(proc, uid, cgroup, gate_w)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        _close_fds(gate_w)
    return proc


def _popen(
    command: list[str],
    rt: RuntimePaths,
    gate: int,
    pass_fds: Sequence[int],
    detach: bool,
    umask: int = -1,
) -> subprocess.Popen[bytes]:
    """``command`` started with its output appended to ``qemu.log`` and its stdin the
    cgroup gate's read end (``gate``; none when negative). ``umask``: its umask (-1: ours)."""
    log_fd = os.open(rt.qemu_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with open(log_fd, "ab") as log_f:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL if gate < 0 else gate,
            stdout=log_f,
            stderr=log_f,
            close_fds=True,
            pass_fds=tuple(pass_fds),
            start_new_session=detach,
            umask=umask,
        )


def _hand_over(
    proc: subprocess.Popen[bytes],
    uid: qemu_user.Lease | None,
    cgroup: cgroups.Group | None,
    gate: int,
) -> None:
    """The started process is given its uid lease and moved into its cgroup, then let
    through the gate (its write end, ``gate``) to become QEMU."""
    if uid is not None:
        uid.bind(proc.pid)  # from now on held for as long as this process lives
    if cgroup is not None:
        cgroups.move(cgroup, proc.pid)
        os.write(gate, b"\n")  # through the gate: it becomes QEMU, in its group


def _wrapped(
    argv: list[str], detach: bool, netns: str | None, cgroup: cgroups.Group | None, drop: bool
) -> list[str]:
    """``argv`` behind the programs that do what would otherwise run before exec
    (``drop``: ``argv`` drops to a uid, see :data:`RUNAS_CAPS`)."""
    command = list(argv)
    if drop or not detach:
        setpriv = hosttools.require("setpriv")
        inner = ["--bounding-set", "-all"] if drop else []
        inner += [] if detach else ["--pdeathsig", "KILL"]
        command = [setpriv, *inner, "--", *command]
        if drop:
            command = [setpriv, "--no-new-privs", "--inh-caps", RUNAS_CAPS, "--", *command]
    if netns is not None:
        command = [
            hosttools.require("nsenter"),
            f"--net={network.NETNS_DIR / netns}",
            "--",
            *command,
        ]
    if cgroup is not None:
        command = [hosttools.require("sh"), "-c", CGROUP_GATE, "forkd-cgroup-gate", *command]
    return command


def _close_fds(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def tail(path: Path, limit: int = 1500) -> str:
    """The last ``limit`` bytes of a log, as text; empty when it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            data = f.read(limit)
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


@functools.cache
def seccomp_problem() -> str | None:
    """Why this host's QEMU cannot run under ``-sandbox``, or None when it can.

    Found once per process by starting QEMU with the filter and no machine:
    a QEMU built without seccomp, or a kernel without it, fails at once.
    VMs then start without ``-sandbox``; the daemon logs it, ``forkd doctor``
    reports it.
    """
    try:
        path = hosttools.require(QEMU_BINARY)
    except ForkdError as exc:
        return str(exc)
    argv = [
        path,
        "-sandbox",
        SANDBOX,
        "-machine",
        "none",
        "-nodefaults",
        "-display",
        "none",
        "-S",
        "-qmp",
        "stdio",
    ]
    quit_cmds = b'{"execute": "qmp_capabilities"}\n{"execute": "quit"}\n'
    try:
        out = subprocess.run(argv, input=quit_cmds, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem: str | None = f"QEMU with -sandbox did not start: {exc}"
    else:
        said = out.stderr.decode(errors="replace").strip()
        problem = None if out.returncode == 0 else f"{said or 'exit status'} ({out.returncode})"
    if problem is not None:
        log.warning("QEMU runs without -sandbox (seccomp): %s", problem)
    return problem


async def _seccomp_ok() -> bool:
    return await asyncio.to_thread(seccomp_problem) is None


@contextlib.contextmanager
def _layer_fds(attach: Sequence[Attachment]) -> Iterator[dict[int, tuple[int, int]]]:
    """Read-only and read-write descriptors of each writable volume's top layer
    (:func:`forkd.vmm.qemu.argv.layer_fdset` says why QEMU gets them), closed on exit:
    QEMU has its own copies by then."""
    with contextlib.ExitStack() as opened:
        fds: dict[int, tuple[int, int]] = {}
        for i, att in enumerate(attach):
            if not att.readonly:
                ro = os.open(att.top, os.O_RDONLY | os.O_CLOEXEC)
                opened.callback(os.close, ro)
                rw = os.open(att.top, os.O_RDWR | os.O_CLOEXEC)
                opened.callback(os.close, rw)
                fds[i] = (ro, rw)
        yield fds


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What a QEMU starts with, every part named where it is made."""

    machine: MachineConfig
    rt: RuntimePaths
    ram_file: Path  # guest RAM: a file QEMU maps shared (a fork's: its snapshot's)
    incoming: bool  # a fork's QEMU, waiting for its snapshot's state
    policy: Egress
    attach: Sequence[Attachment] = ()
    shares: Sequence[Share] = ()  # host directories in the machine's share slots
    detach: bool = False  # outlives this process (a daemon's sandboxes)
    host_network: network.HostNetwork | None = None  # a network namespace of its own
    placement: cgroups.Placement | None = None  # a cgroup of its own, there


async def start_qemu(spec: LaunchSpec, undo: contextlib.AsyncExitStack) -> Launched:
    """Start QEMU as ``spec`` says: in a cgroup of its own when ``placement`` says
    where, in a network namespace of its own when it gets one, dropped to a uid of its
    own (:mod:`forkd.vmm.jail.qemu_user`).

    ``undo`` is the start's one undo stack: each thing is pushed onto it as soon as it
    is made (group, uid, namespace, process), so whoever unwinds it after a failure,
    here or later in the start, leaves nothing behind.
    """
    machine, rt = spec.machine, spec.rt
    group = None
    if spec.placement is not None:
        caps = cgroups.limits_for(
            machine.memory_mib, machine.vcpus, machine.accel, spec.placement.memory_limit_mib
        )
        group = await asyncio.to_thread(spec.placement.hierarchy.create, rt.dir.name, caps)
        undo.push_async_callback(asyncio.to_thread, cgroups.remove, group, 1.0)
    sandbox = await _seccomp_ok()
    uid = await asyncio.to_thread(qemu_user.reserve)
    if uid is not None:
        undo.push_async_callback(asyncio.to_thread, uid.release)
    net = await network.attach(spec.host_network, rt.dir.name, spec.policy)
    undo.push_async_callback(network.detach, net)
    if spec.host_network is not None and net is None:
        # The daemon's fallback: QEMU's NAT would reach the host's loopback
        # (10.0.2.2 is the host), so no egress at all, whatever the policy.
        machine = dataclasses.replace(machine, internet=False)
    with _layer_fds(spec.attach) as layer_fds:
        argv = build_argv(
            machine,
            rt,
            ram_file=spec.ram_file,
            incoming=spec.incoming,
            volumes=spec.attach,
            tap=net is not None,
            sandbox=sandbox,
            runas=uid.runas if uid else None,
            layer_fds=layer_fds,
            shares=spec.shares,
        )
        kept = [fd for pair in layer_fds.values() for fd in pair]
        try:
            proc = spawn(
                argv,
                rt,
                spec.detach,
                netns=net.netns if net else None,
                cgroup=group,
                pass_fds=kept,
                uid=uid,
                # A share's files are made for every sandbox's QEMU user to use:
                # the modes they are asked with (shares.fsdev_args) must hold.
                umask=0 if spec.shares else -1,
            )
        except subprocess.SubprocessError as exc:  # the child's setup failed
            raise VMError(f"QEMU could not enter its cgroup or namespace: {exc}") from exc
    undo.callback(_reap, proc)
    return Launched(proc, net, group, uid)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """A QEMU whose start failed later on: gone before its uid, namespace and group are."""
    proc.kill()
    proc.wait()
