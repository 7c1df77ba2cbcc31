"""One VM's QMP connection, where a QEMU that stops answering is an error, not a hang.

Protocol and transport are :mod:`qemu.qmp`'s; this adds the deadlines and
turns every failure into :class:`forkd.errors.VMError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from forkd.errors import SnapshotError, VMError
from forkd.vmm.qemu.argv import FD_READ_ONLY, FD_READ_WRITE
from forkd.vmm.qemu.launch import tail

QMP_TIMEOUT_SECS = 30.0
CONNECT_TIMEOUT_SECS = 15.0
POLL_SECS = 0.002
_FD_TAGS = {os.O_RDONLY: FD_READ_ONLY, os.O_WRONLY: "wo", os.O_RDWR: FD_READ_WRITE}


class QMPChannel:
    def __init__(self, vm_id: str, sock: Path) -> None:
        self.vm_id = vm_id
        self.sock = sock
        self.client = QMPClient(vm_id)

    async def connect(
        self, raise_if_dead: Callable[[str], None], timeout: float = CONNECT_TIMEOUT_SECS
    ) -> None:
        """Connect once QEMU has opened its socket; ``raise_if_dead`` stops the wait."""
        deadline = time.monotonic() + timeout
        while True:
            raise_if_dead("QEMU exited while starting")
            if self.sock.exists():
                try:
                    await asyncio.wait_for(self.client.connect(str(self.sock)), QMP_TIMEOUT_SECS)
                    return
                except (QMPError, TimeoutError) as exc:
                    if time.monotonic() > deadline:
                        raise VMError(f"cannot connect to QMP at {self.sock}: {exc}") from exc
            if time.monotonic() > deadline:
                raise VMError(f"QEMU did not open {self.sock} within {timeout:g} s")
            await asyncio.sleep(POLL_SECS)

    async def set_running(self, running: bool) -> None:
        """The vCPUs running (``cont``) or stopped (``stop``), unless they already are."""
        status = await self.execute("query-status")
        if not isinstance(status, dict):
            raise VMError(f"QEMU of {self.vm_id} answered query-status with {status!r}")
        if (status.get("running") is True) != running:
            await self.execute("cont" if running else "stop")

    async def execute(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float = QMP_TIMEOUT_SECS
    ) -> Any:
        """One QMP command and its answer."""
        try:
            return await asyncio.wait_for(self.client.execute(cmd, args), timeout)
        except TimeoutError as exc:
            raise VMError(
                f"QEMU of {self.vm_id} did not answer {cmd!r} within {timeout:g} s"
            ) from exc
        except (QMPError, OSError) as exc:  # a refusal, or the connection went (QEMU died)
            raise VMError(f"QMP {cmd!r} to {self.vm_id} failed: {exc}") from exc

    async def wait_accepted(self, chardev: str, timeout: float) -> None:
        """Until QEMU has accepted a client on its server socket chardev ``chardev``.

        A client's ``connect()`` returns as soon as the kernel queues it; QEMU
        accepts it later, in its main loop, and until then reports the chardev
        as ``disconnected:...``. :meth:`forkd.vmm.vm.VM.finish_restore` says why
        the difference matters.
        """
        deadline = time.monotonic() + timeout
        while True:
            chardevs = await self.execute("query-chardev")
            assert isinstance(chardevs, list)
            found = [c for c in chardevs if c.get("label") == chardev]
            if not found:
                raise VMError(f"QEMU of {self.vm_id} has no chardev {chardev!r}")
            if not str(found[0].get("filename", "")).startswith("disconnected:"):
                return
            if time.monotonic() > deadline:
                raise VMError(
                    f"QEMU of {self.vm_id} did not accept the connection to its "
                    f"{chardev!r} socket within {timeout:g} s"
                )
            await asyncio.sleep(POLL_SECS)

    async def add_fdset(self, path: Path, modes: Sequence[int]) -> int:
        """Open ``path`` once per access mode and hand the descriptors to QEMU as a new
        fd set; QEMU then opens ``/dev/fdset/<id>`` (the id returned).

        QEMU, once it dropped to its uid (:mod:`forkd.vmm.jail.qemu_user`), may
        not open forkd's files by name: this is how it gets one it needs
        later, such as a snapshot's device state or a new volume layer.
        """
        fdset: int | None = None
        try:
            for mode in modes:
                fd = os.open(path, mode | os.O_CLOEXEC)
                try:
                    self.send_fd(fd)
                    args: dict[str, Any] = {"opaque": _FD_TAGS[mode & os.O_ACCMODE]}
                    if fdset is not None:
                        args["fdset-id"] = fdset
                    added = await self.execute("add-fd", args)
                finally:
                    os.close(fd)
                assert isinstance(added, dict)
                fdset = int(added["fdset-id"])
        except BaseException:
            if fdset is not None:
                await self.remove_fdset(fdset)
            raise
        assert fdset is not None
        return fdset

    async def release_writers(self) -> None:
        """Take every read-write descriptor out of QEMU's fd sets; QEMU keeps its copies.

        Call it while the VM runs: QEMU closes a removed descriptor at once
        only then. Why it matters: :func:`forkd.vmm.qemu.argv.layer_fdset`.
        """
        fdsets = await self.execute("query-fdsets")
        assert isinstance(fdsets, list)
        for fdset in fdsets:
            for fd in fdset.get("fds", []):
                if fd.get("opaque") == FD_READ_WRITE:
                    await self.execute("remove-fd", {"fdset-id": fdset["fdset-id"], "fd": fd["fd"]})

    async def remove_fdset(self, fdset: int) -> None:
        """Let QEMU close an fd set's descriptors once it no longer uses them."""
        with contextlib.suppress(VMError):
            await self.execute("remove-fd", {"fdset-id": fdset})

    def send_fd(self, fd: int) -> None:
        """Pass a file descriptor to QEMU (named by a following ``getfd``)."""
        self.client.send_fd_scm(fd)

    async def disconnect(self) -> None:
        await self.client.disconnect()

    async def save_device_state(self, fdset: int) -> None:
        """Write the devices' state (not the guest's memory) into fd set ``fdset``; the
        VM must be paused. Read back by :meth:`load_vmstate`."""
        await self.execute(
            "xen-save-devices-state", {"filename": f"/dev/fdset/{fdset}", "live": False}
        )

    async def load_vmstate(self, vmstate: Path, timeout: float, qemu_log: Path) -> None:
        """Feed a snapshot's device state to a QEMU started with ``-incoming defer``.

        Returns once QEMU has loaded it (the vCPUs still stopped); a failure is a
        :class:`SnapshotError` naming ``vmstate`` and what QEMU logged.
        """
        fd = os.open(vmstate, os.O_RDONLY)
        try:
            self.send_fd(fd)
            await self.execute("getfd", {"fdname": "vmstate"})
        finally:
            os.close(fd)
        await self.execute("migrate-incoming", {"uri": "fd:vmstate"})
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = await self.execute("query-status")
            except VMError as exc:
                raise SnapshotError(
                    f"loading {vmstate} failed (QEMU: {tail(qemu_log) or exc})"
                ) from exc
            assert isinstance(status, dict)
            if status["status"] != "inmigrate":
                break
            if time.monotonic() > deadline:
                raise SnapshotError(f"loading {vmstate} did not finish within {timeout:g} s")
            await asyncio.sleep(POLL_SECS)
        mig = await self.execute("query-migrate")
        assert isinstance(mig, dict)
        if mig.get("status") not in (None, "completed"):
            raise SnapshotError(
                f"loading {vmstate} failed: migration {mig.get('status')} "
                f"({mig.get('error-desc') or tail(qemu_log)})"
            )

    async def console_ring(self, limit: int) -> str:
        """The end of the guest console's ring buffer (a fork's console); "" if unreadable."""
        try:
            data = await self.execute(
                "ringbuf-read", {"device": "console", "size": limit, "format": "utf8"}, 5.0
            )
        except (VMError, OSError):
            return ""
        return str(data).strip()
