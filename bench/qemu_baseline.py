"""The plain-QEMU baseline of bench/fork.py: what a QEMU user would do instead of a fork.

Save (:func:`save_to_file`): ``stop``, then QMP ``migrate`` of the whole VM, RAM
included, into a file, until ``query-migrate`` says ``completed``. The file
reaches QEMU as a descriptor (``getfd``, URI ``fd:``): forkd's QEMU runs under
``-sandbox ...,spawn=deny``, so an ``exec:cat > FILE`` URI could not fork a
shell, and after ``-runas`` it may not open the bench's files by name. The
migration bandwidth is unthrottled first (QEMU's default is 32 MiB/s), as
libvirt does for ``virsh save``. forkd's guest RAM is a ``share=off`` file
mapping, which QEMU migrates in full (``x-ignore-shared`` applies only to
shared RAM): the file holds every non-zero page, zero pages as short markers.

Restore (:func:`start_incoming`, :func:`restore_from_file`): a new QEMU with
the template's machine and devices (forkd's own :func:`build_argv`, a fresh run
directory, a fresh sparse RAM file, ``-incoming defer``), ``migrate-incoming``
from the file, ``cont``, until the guest agent answers a ping. forkd's restores
pass ``-global migration.send-configuration=off`` (their device state has no
configuration section); a full migration stream has one, so that option is
left out here, as a QEMU user would.

Neither time includes an fsync of the file (nor does ``virsh save`` by
default). The first save and restore of a run are usually several times
slower than the next ones (memory the host touches for the first time);
fork.py reports the p50 and every run.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from forkd import limits
from forkd.errors import VMError
from forkd.states import VMState
from forkd.vmm.jail import qemu_user
from forkd.vmm.qemu import launch
from forkd.vmm.qemu.argv import AGENT_CHARDEV, MachineConfig, RuntimePaths, build_argv
from forkd.vmm.qemu.launch import tail
from forkd.vmm.vm import VM

SAVE_FD_NAME = "bench-save"
MAX_BANDWIDTH = 1 << 50  # bytes/s: no throttle (QEMU caps the value at SIZE_MAX / 1000)
SEND_CONFIG_OFF = ("-global", "migration.send-configuration=off")
POLL_SECS = 0.002
TIMEOUT_SECS = limits.RESTORE_TIMEOUT_SECS * 4  # a save or restore of a busy TCG host


async def wait_migration(vm: VM, what: str, timeout: float = TIMEOUT_SECS) -> None:
    """Until ``query-migrate`` says ``completed``; :class:`VMError` if it fails or hangs."""
    deadline = time.monotonic() + timeout
    while True:
        mig = await vm.qmp.execute("query-migrate")
        assert isinstance(mig, dict)
        status = mig.get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            said = mig.get("error-desc") or tail(vm.rt.qemu_log, 500)
            raise VMError(f"{what}: migration {status} ({said})")
        if time.monotonic() > deadline:
            raise VMError(f"{what}: migration still {status} after {timeout:g} s")
        await asyncio.sleep(POLL_SECS)


async def save_to_file(vm: VM, dest: Path) -> float:
    """``stop`` and ``migrate`` ``vm`` (RAM included) into ``dest`` (made here); returns
    the ms from ``stop`` to ``completed``. The VM is left paused (``postmigrate``):
    ``cont`` runs it again."""
    await vm.qmp.execute("migrate-set-parameters", {"max-bandwidth": MAX_BANDWIDTH})
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        vm.qmp.send_fd(fd)
        await vm.qmp.execute("getfd", {"fdname": SAVE_FD_NAME})
    finally:
        os.close(fd)  # QEMU holds its own copy
    started = time.monotonic()
    await vm.qmp.execute("stop")
    vm._set_state(VMState.PAUSED)
    await vm.qmp.execute("migrate", {"uri": f"fd:{SAVE_FD_NAME}"})
    await wait_migration(vm, f"saving {vm.id} to {dest}")
    return (time.monotonic() - started) * 1000


def incoming_argv(
    machine: MachineConfig, vm_dir: Path, ram: Path, sandbox: bool, runas: str | None = None
) -> list[str]:
    """forkd's QEMU command line for a restore of ``machine``, less the option that
    makes QEMU expect device state without a configuration section."""
    argv = build_argv(
        machine,
        RuntimePaths(vm_dir),
        ram_file=ram,
        incoming=True,
        sandbox=sandbox,
        runas=runas,
        boot_files=True,  # the stream's ROMs (the kernel loader's) must be there
    )
    for i in range(len(argv) - 1):
        if (argv[i], argv[i + 1]) == SEND_CONFIG_OFF:
            return argv[:i] + argv[i + 2 :]
    raise VMError(f"forkd's restore command line no longer has {' '.join(SEND_CONFIG_OFF)}")


async def start_incoming(machine: MachineConfig, run_root: Path) -> VM:
    """Start a QEMU with ``machine``'s devices waiting for a migration stream.

    Returns a :class:`VM` around it (state ``incoming``) before any await, so the
    caller can track it at once; on failure here nothing is left running.
    """
    sandbox = await asyncio.to_thread(launch.seccomp_problem) is None
    vm_id = f"qemu-{secrets.token_hex(4)}"
    rt = launch.prepare_runtime(run_root, vm_id)
    proc: subprocess.Popen[bytes] | None = None
    uid = None
    try:
        with rt.ram.open("wb") as f:  # sparse, as for a boot: the stream fills it
            f.truncate(machine.memory_mib << 20)
        uid = await asyncio.to_thread(qemu_user.reserve)  # a uid of its own, as forkd's
        argv = incoming_argv(machine, rt.dir, rt.ram, sandbox, uid.runas if uid else None)
        proc = launch.spawn(argv, rt, detach=False, uid=uid)
        vm = VM(vm_id, rt, machine, rt.ram, None, None, proc, proc.pid)
        vm.uid = uid  # given back by vm.kill()
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.wait()
        if uid is not None:
            uid.release()
        shutil.rmtree(rt.dir, ignore_errors=True)
        raise
    vm._set_state(VMState.INCOMING)
    return vm


async def restore_from_file(vm: VM, src: Path, timeout: float = TIMEOUT_SECS) -> None:
    """Load ``src`` (a :func:`save_to_file` stream) into ``vm`` from :func:`start_incoming`,
    ``cont``, and return once the guest agent answered a ping.

    The agent's socket is connected, and QEMU has accepted it, before ``cont``:
    the saved state says a host was connected (see ``VM.finish_restore``).
    """
    await vm.qmp.connect(vm._raise_if_dead)
    await vm.agent.connect()
    # Sends the descriptor (getfd), migrate-incoming fd:..., waits until loaded.
    await vm.qmp.load_vmstate(src, timeout, vm.rt.qemu_log)
    await vm.qmp.wait_accepted(AGENT_CHARDEV, timeout)
    await vm.qmp.execute("cont")
    vm._set_state(VMState.RUNNING)
    await vm.agent.call("ping", wait=timeout)


def table_rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    """The baseline's rows of fork.py's main table: (label, value)."""

    def ms(key: str) -> str:
        value = res.get(key)
        return "-" if value is None else f"{value} ms"

    def ratio(key: str) -> str:
        value = res.get(key)
        return "-" if value is None else f"{value}x"

    runs = res.get("qemu_baseline_runs")
    disk = f"{res.get('qemu_save_file_mib')} / {res.get('forkd_snapshot_disk_mib')} MiB"
    return [
        (f"plain QEMU save: stop + migrate to a file, p50 of {runs}", ms("qemu_save_ms")),
        (
            f"plain QEMU restore: -incoming from the file -> agent, p50 of {runs}",
            ms("qemu_restore_ms"),
        ),
        ("plain QEMU restore p50 / fork p50", ratio("fork_vs_qemu_restore_ratio")),
        ("plain QEMU restore p50 / pool-hit fork p50", ratio("pool_hit_vs_qemu_restore_ratio")),
        ("disk: QEMU save file / forkd snapshot (memory.bin + vmstate)", disk),
    ]
