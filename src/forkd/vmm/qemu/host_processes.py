"""Finding forkd's QEMU processes on this host by their command lines in ``/proc``.

A QEMU started detached outlives the process that started it; these scans
find it again (to adopt it, to tell it from a reused pid, or to kill it as a
stray) from the run directory its command line names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from forkd.vmm.qemu.argv import QEMU_BINARY

PROC = Path("/proc")
QEMU_NAME_PREFIX = b"qemu-system"
QMP_SOCKET = "qmp.sock"
QMP_OPTION_TAIL = b",server=on,wait=off"  # after the socket path in ``-qmp unix:...``


def _cmdline(pid: int | str) -> list[bytes] | None:
    try:
        data = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:  # gone, or not ours to read
        return None
    return data.split(b"\0")


def _is_qemu(argv: list[bytes]) -> bool:
    return os.path.basename(argv[0]).startswith(QEMU_NAME_PREFIX)


def _qemus() -> Iterator[tuple[int, list[bytes]]]:
    """Every QEMU process visible here, with its argv."""
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(entry.name)
        if argv is not None and _is_qemu(argv):
            yield int(entry.name), argv


def qemu_pid_matches(pid: int, run_dir: Path) -> bool:
    """True when ``pid`` is alive and is the QEMU whose sockets live in ``run_dir``."""
    argv = _cmdline(pid)
    if argv is None:
        return False
    needle = str(run_dir / QMP_SOCKET).encode()
    return any(needle in arg for arg in argv)


def qemu_pids_under(root: Path) -> list[int]:
    """QEMU processes whose command line names a path under ``root``."""
    needle = str(root).rstrip("/").encode() + b"/"
    return sorted(pid for pid, argv in _qemus() if any(needle in arg for arg in argv))


def qemu_run_dirs(run_root: Path) -> dict[int, Path]:
    """pid → run directory, for each QEMU whose QMP socket is in a directory of ``run_root``.

    Only ``<run_root>/<name>/qmp.sock`` counts: the layout
    :class:`forkd.vmm.qemu.argv.RuntimePaths` gives every VM.
    """
    found: dict[int, Path] = {}
    for pid, argv in _qemus():
        if not argv[0].endswith(QEMU_BINARY.encode()):
            continue
        for arg in argv:
            run_dir = _qmp_run_dir(arg)
            if run_dir is not None and _directly_under(run_dir, run_root):
                found[pid] = run_dir
                break
    return found


def _directly_under(run_dir: Path, run_root: Path) -> bool:
    """``run_dir`` is a real child of ``run_root``: no ``..``, no link out of it."""
    if run_dir.parent != run_root or run_dir.name in ("", ".", ".."):
        return False
    return Path(os.path.realpath(run_dir)).parent == Path(os.path.realpath(run_root))


def _qmp_run_dir(arg: bytes) -> Path | None:
    """The directory of the QMP socket named by a ``-qmp`` value, if ``arg`` is one."""
    if not arg.startswith(b"unix:") or not arg.endswith(QMP_OPTION_TAIL):
        return None
    # QEMU option strings double every comma of a path (forkd.vmm.qemu.argv._opt).
    sock = Path(os.fsdecode(arg[len(b"unix:") : -len(QMP_OPTION_TAIL)]).replace(",,", ","))
    return sock.parent if sock.name == QMP_SOCKET else None


def memory_usage(pid: int) -> dict[str, int]:
    """Host memory of process ``pid``, from /proc/PID/smaps_rollup, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key.strip().lower()] = int(parts[0]) * 1024
    # What the VM alone costs the host: pages only it has written (QEMU's
    # heap, the TCG cache, guest pages it changed). Private_Clean is left
    # out: it counts snapshot pages that happen to be mapped by no other
    # child right now, which are page cache, not owned memory.
    out["private"] = out.get("private_dirty", 0)
    return out


def resident_memory(pid: int) -> dict[str, int]:
    """What process ``pid`` holds in RAM now, from /proc/PID/status, in bytes: ``rss``,
    ``anon`` (its own pages: QEMU's heap and translation cache, the guest pages it
    wrote; a QEMU shares none with another) and ``file`` (mapped files: a snapshot's
    pages it reads, shared with its siblings). A few microseconds, where
    :func:`memory_usage` takes a millisecond or more: read for every sandbox at once."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keys:
                out[keys[key]] = int(rest.split()[0]) * 1024
    return out


def cpu_times(pid: int) -> tuple[float, float]:
    """(user and system CPU seconds process ``pid`` has used, its threads included;
    seconds since it started), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the command, which may hold spaces
    hz = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / hz, max(0.0, uptime - int(fields[19]) / hz)


def owner_uid(pid: int) -> int | None:
    """The real user id process ``pid`` runs as, or None when it is gone.

    Read from ``status``: the owner of ``/proc/<pid>`` is root for a process
    that changed its user (QEMU after ``-runas``), whatever its user now is.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
