"""Starting a QEMU process in a fresh run directory of its own.

The directory holds the process's sockets and logs (:class:`RuntimePaths`);
:func:`tail` reads the end of those logs back for error messages.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from forkd import hosttools
from forkd.errors import VMError
from forkd.vmm import network
from forkd.vmm.egress import Egress
from forkd.vmm.qemu_argv import QEMU_BINARY, MachineConfig, RuntimePaths, build_argv
from forkd.vmm.volumes import Attachment

UNIX_PATH_MAX = 107
PR_SET_PDEATHSIG = 1

_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up now, not in a forked child


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def prepare_runtime(run_root: Path, vm_id: str) -> RuntimePaths:
    """Create ``<run_root>/<vm_id>``, which must not exist yet."""
    rt = RuntimePaths(run_root / vm_id)
    if len(str(rt.agent)) > UNIX_PATH_MAX:
        raise VMError(f"run directory {rt.dir} is too long for unix sockets")
    rt.dir.mkdir(mode=0o700, parents=True, exist_ok=False)  # sockets, logs, guest RAM
    return rt


def spawn(
    argv: list[str], rt: RuntimePaths, detach: bool, netns: str | None = None
) -> subprocess.Popen[bytes]:
    """Start QEMU with its output in ``qemu.log``; on failure the run directory is removed.

    ``detach``: in a session of its own, to outlive this process (a daemon's
    sandboxes); otherwise killed when this process dies. ``netns``: the
    network namespace (under /run/netns) QEMU starts in.
    """
    steps: list[Callable[[], None]] = []
    if not detach:
        steps.append(_die_with_parent)
    if netns is not None:
        steps.append(network.enter_netns(netns))

    def child_setup() -> None:  # runs in the child between fork and exec
        for step in steps:
            step()

    try:
        hosttools.require(QEMU_BINARY)
        log_fd = os.open(rt.qemu_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with open(log_fd, "ab") as log_f:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_f,
                stderr=log_f,
                close_fds=True,
                start_new_session=detach,
                preexec_fn=child_setup if steps else None,
            )
    except BaseException:
        shutil.rmtree(rt.dir, ignore_errors=True)
        raise


def tail(path: Path, limit: int = 1500) -> str:
    """The last ``limit`` bytes of a log, as text; empty when it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            data = f.read(limit)
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


async def start_qemu(
    machine: MachineConfig,
    rt: RuntimePaths,
    ram_file: Path,
    incoming: bool,
    attach: Sequence[Attachment],
    detach: bool,
    host_network: network.HostNetwork | None,
    policy: Egress,
) -> tuple[network.SandboxNet | None, subprocess.Popen[bytes]]:
    """Make the VM's network namespace (when it gets one), then start QEMU in it.

    On failure nothing is left: no namespace, no run directory.
    """
    try:
        net = await network.attach(host_network, rt.dir.name, policy)
    except BaseException:
        shutil.rmtree(rt.dir, ignore_errors=True)
        raise
    argv = build_argv(machine, rt, ram_file=ram_file, incoming=incoming, volumes=attach,
                      tap=net is not None)  # fmt: skip
    try:
        return net, spawn(argv, rt, detach, netns=net.netns if net else None)
    except BaseException:
        await network.detach(net)
        raise
