"""Which pages of a running guest's RAM were written since a given moment.

A live snapshot copies the guest's pages while it runs and pauses it only to
copy again what was written since that copy. Knowing "written since" needs
the kernel's help, and this host kernel family gives it two ways:

* soft-dirty bits (``/proc/PID/clear_refs``): not in every kernel build (this
  project's CI host has none);
* a userfaultfd in asynchronous write-protect mode (``UFFD_FEATURE_WP_ASYNC``,
  Linux 6.7) over guest RAM, read and re-armed in one ``PAGEMAP_SCAN`` ioctl
  on ``/proc/PID/pagemap``. A write to a protected page costs one minor fault
  that the kernel resolves itself; nobody has to serve it.

This module uses the second: it works on every memory type (guest RAM here is
a private file mapping, which synchronous userfaultfd write-protect refuses)
and on any kernel from 6.7. The userfaultfd must be made inside QEMU (it
watches its creator's address space): :mod:`forkd.vmm.snapshot.remote_syscall` makes
it there, the daemon takes the descriptor over and QEMU's copy is closed, so
the daemon's descriptor is the only one and closing it ends the tracking.
Where any piece is missing :func:`problem` says which, and callers fall back
to copying inside the pause.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Literal

from forkd.vmm.snapshot import remote_syscall

_UFFD_API = 0xAA
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_REGISTER_MODE_WP = 1 << 1
_UFFD_FEATURE_WP_UNPOPULATED = 1 << 13
_UFFD_FEATURE_WP_ASYNC = 1 << 15
_UFFD_USER_MODE_ONLY = 1  # enough for QEMU's own accesses; allowed unprivileged
_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
_PM_SCAN_WP_MATCHING = 1 << 0
_PM_SCAN_CHECK_WPASYNC = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1
_VEC_LEN = 4096  # page ranges per PAGEMAP_SCAN call

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long


class _ScanArg(ctypes.Structure):
    """``struct pm_scan_arg``."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            *("size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages"),
            *("category_inverted", "category_mask", "category_anyof_mask", "return_mask"),
        )
    ]


class _PageRegion(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("start", "end", "categories")]


_problem: str | Literal[False] | None = False  # False: not probed yet


def problem() -> str | None:
    """Why this host cannot track writes (None: it can). Probed once, in this process."""
    global _problem
    if _problem is False:
        _problem = _probe()
    return _problem


def _probe() -> str | None:
    if not remote_syscall.supported():
        return "write tracking needs an x86-64 host"
    if os.geteuid() != 0:
        # Unprivileged, pagemap hides swap types: the markers the tracker leaves
        # would read as written pages (see forkd.vmm.snapshot.memory.pagemap_marks).
        return "write tracking needs the daemon to run as root"
    fd = _libc.syscall(remote_syscall.SYS_USERFAULTFD, os.O_CLOEXEC | _UFFD_USER_MODE_ONLY)
    if fd < 0:
        return f"userfaultfd is not available ({os.strerror(ctypes.get_errno())})"
    try:
        api = bytearray(struct.pack("QQQ", _UFFD_API, 0, 0))
        fcntl.ioctl(fd, _UFFDIO_API, api)
        features = struct.unpack("QQQ", api)[1]
        needed = _UFFD_FEATURE_WP_ASYNC | _UFFD_FEATURE_WP_UNPOPULATED
        if features & needed != needed:
            return "the kernel has no asynchronous userfaultfd write-protect (Linux 6.7+)"
    except OSError as exc:
        return f"userfaultfd API handshake failed: {exc}"
    finally:
        os.close(fd)
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        arg = _ScanArg(size=ctypes.sizeof(_ScanArg))
        failed = _libc.ioctl(pagemap, _PAGEMAP_SCAN, ctypes.addressof(arg)) < 0
        if failed and ctypes.get_errno() == errno.ENOTTY:
            return "the kernel has no PAGEMAP_SCAN (Linux 6.7+)"
    finally:
        os.close(pagemap)
    return None


@dataclass
class WriteTracker:
    """Write tracking over one QEMU process's guest RAM (``[start, end)`` in its memory)."""

    pid: int
    start: int
    end: int
    _uffd: int = -1
    _pagemap: int = -1
    # A scan (a worker thread) and a close (the VM being killed) never overlap: a
    # closed descriptor's number could be reused for another file meanwhile.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def attach(cls, pid: int, start: int, end: int) -> WriteTracker:
        """Start tracking; blocking (a few ms, one QEMU thread stopped meanwhile).

        Raises OSError when the host cannot (see :func:`problem`) or QEMU refused.
        """
        reason = problem()
        if reason is not None:
            raise OSError(errno.ENOTSUP, reason)
        tracker = cls(pid, start, end)
        remote = remote_syscall.call(
            pid, remote_syscall.SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY
        )
        if remote < 0:
            raise OSError(-remote, f"userfaultfd in QEMU {pid}: {os.strerror(-remote)}")
        try:
            tracker._uffd = remote_syscall.take_fd(pid, remote)
            remote_syscall.call(pid, remote_syscall.SYS_CLOSE, remote)
            # QEMU could have put anything at that number meanwhile: only ever touch
            # a userfaultfd (of its address space: the registration checks that).
            if os.readlink(f"/proc/self/fd/{tracker._uffd}") != "anon_inode:[userfaultfd]":
                raise OSError(errno.EBADF, f"QEMU {pid} handed over something else")
            tracker._register()
            tracker._pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            tracker.close()
            raise
        return tracker

    def _register(self) -> None:
        features = _UFFD_FEATURE_WP_ASYNC | _UFFD_FEATURE_WP_UNPOPULATED
        fcntl.ioctl(self._uffd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, features, 0)))
        reg = struct.pack("QQQQ", self.start, self.end - self.start, _UFFDIO_REGISTER_MODE_WP, 0)
        fcntl.ioctl(self._uffd, _UFFDIO_REGISTER, bytearray(reg))

    def written_since_last(self) -> list[tuple[int, int]]:
        """Guest-RAM offsets ``[first, end)`` (bytes) written since the last call, which
        re-arms them: the next call reports only what is written after this one.

        The first call reports every page: nothing was protected before it.
        """
        with self._lock:
            if self._pagemap < 0:
                raise OSError(errno.EBADF, f"the write tracker of QEMU {self.pid} is closed")
            return self._scan()

    def _scan(self) -> list[tuple[int, int]]:
        vec = (_PageRegion * _VEC_LEN)()
        runs: list[tuple[int, int]] = []
        start = self.start
        while start < self.end:
            arg = _ScanArg(
                size=ctypes.sizeof(_ScanArg),
                flags=_PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC,
                start=start,
                end=self.end,
                vec=ctypes.addressof(vec),
                vec_len=_VEC_LEN,
                category_mask=_PAGE_IS_WRITTEN,
                return_mask=_PAGE_IS_WRITTEN,
            )
            found = _libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.addressof(arg))
            if found < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"PAGEMAP_SCAN of QEMU {self.pid}: {os.strerror(err)}")
            runs.extend((vec[i].start - self.start, vec[i].end - self.start) for i in range(found))
            if arg.walk_end <= start:
                raise OSError(errno.EIO, f"PAGEMAP_SCAN of QEMU {self.pid} made no progress")
            start = arg.walk_end
        return runs

    def close(self) -> None:
        """Stop tracking (the kernel drops the protection with the last descriptor)."""
        with self._lock:
            for name in ("_uffd", "_pagemap"):
                fd = getattr(self, name)
                if fd >= 0:
                    os.close(fd)
                    setattr(self, name, -1)
