"""A daemon killed with SIGKILL in the middle of an import (issue 35): its flattening worker
and tar2sqfs die with it (nothing runs on under the uid leased for them, which is free
again), and the next daemon to start removes the staging directory and the partial
archive the dead one left, keeping what a live forkd process still writes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkd import paths, processes
from forkd.vmm.jail import qemu_user
from tests import oci_images
from tests.integration.conftest import Daemon

pytestmark = pytest.mark.integration


def children(pid: int) -> list[tuple[int, str]]:
    """The processes whose parent is ``pid``: (pid, command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2 :].split()[1]) == pid:
            found.append((int(entry), cmdline.decode(errors="replace")))
    return found


def alive(pid: int) -> bool:
    return processes.Holder.of(pid) is not None


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="forkd-crash-", dir="/tmp"))
    d = Daemon(root)
    d.start("--kill-on-exit", "--image-archive-dir", str(tmp_path))
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def kill_9(d: Daemon) -> int:
    assert d.proc is not None
    pid = d.proc.pid
    os.kill(pid, signal.SIGKILL)
    d.proc.wait(10)
    return pid


def test_a_daemon_killed_mid_import_leaves_no_worker_and_its_leftovers_are_swept(
    daemon: Daemon, tmp_path: Path
) -> None:
    # 300 MiB of random bytes: seconds for tar2sqfs to compress, time to be killed in.
    big = oci_images.layer({"big.bin": os.urandom(300 << 20)}, "none")
    archive = oci_images.write_oci_archive(tmp_path / "big.tar", {"1": oci_images.image([big])})
    del big
    assert daemon.proc is not None and daemon.token is not None
    me = processes.Holder.of(daemon.proc.pid)
    sock = socket.create_connection(("127.0.0.1", daemon.port or 0))
    # A load whose archive has come in part: its temporary file is in the store.
    sock.sendall(
        b"POST /v1/images/load?tag=half:1 HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + daemon.token.encode() + b"\r\n"
        b"Content-Length: 67108864\r\n\r\n" + os.urandom(4 << 20)
    )
    # An import that reaches tar2sqfs.
    importing = threading.Thread(target=_import, args=(daemon, f"oci-archive:{archive}:1"))
    importing.start()
    worker = tar2sqfs = None
    deadline = time.monotonic() + 120
    while tar2sqfs is None:
        assert time.monotonic() < deadline and importing.is_alive(), "no tar2sqfs was seen"
        workers = [p for p, cmd in children(daemon.proc.pid) if "flatten_worker" in cmd]
        if workers:
            worker = workers[0]
            found = [p for p, cmd in children(worker) if "tar2sqfs" in cmd]
            tar2sqfs = found[0] if found else None
        time.sleep(0.01)
    assert worker is not None
    held = [uid for uid in _leased_uids() if _holder(uid) == worker]
    staging = [
        p for p in paths.images_dir().glob(".staging-*") if processes.marked_by(p.name) == me
    ]
    partial = [
        p
        for p in (paths.blobs_dir() / "tmp").iterdir()
        if p.name.endswith(".load.tar") and processes.marked_by(p.name) == me
    ]
    killed = kill_9(daemon)
    sock.close()
    importing.join(30)
    assert staging and partial, (staging, partial)
    deadline = time.monotonic() + 10
    while (alive(worker) or alive(tar2sqfs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker) and not alive(tar2sqfs), "the import's processes outlived the daemon"
    if os.geteuid() == 0:  # a root daemon leases tar2sqfs a uid: free with its worker gone
        assert held, "the worker held no uid"
        assert all(_holder(uid) is None for uid in held)
    # What a live process is writing is kept by the next daemon's sweep.
    live = paths.images_dir() / f".staging-live-{processes.mark()}x"
    live.mkdir(parents=True)
    try:
        daemon.start("--kill-on-exit", "--image-archive-dir", str(tmp_path))
        assert daemon.proc is not None and daemon.proc.pid != killed
        assert not any(p.exists() for p in (*staging, *partial)), (staging, partial)
        assert live.exists()
    finally:
        live.rmdir()


def _import(daemon: Daemon, ref: str) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{daemon.url}/v1/images", json={"ref": ref}, headers=headers, timeout=120)


def _leased_uids() -> list[int]:
    try:
        return [int(n) for n in os.listdir(qemu_user.REGISTRY_DIR) if n.isdigit()]
    except FileNotFoundError:
        return []


def _holder(uid: int) -> int | None:
    try:
        _version, pid, _ticks = (qemu_user.REGISTRY_DIR / str(uid)).read_text().split()
    except (OSError, ValueError):
        return None
    return int(pid) if alive(int(pid)) else None
