"""Network namespaces made and entered on a thread of this process, and nftables
rulesets loaded through libnftables.

pyroute2 makes a namespace, and opens a socket inside one, in a forked child
process; ``nft -f -`` is a child too. A daemon holding many VMs is a large
process, so each of those forks cost milliseconds of CPU, and a fork of a
sandbox made four of them. A network namespace belongs to a thread, not to a
process: a short-lived thread can ``unshare`` or ``setns`` into one, do its
work there (sockets it opens stay in that namespace) and exit, leaving the
rest of the daemon where it was.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from forkd.errors import VMError

T = TypeVar("T")

NETNS_DIR = Path("/run/netns")  # where ip(8) and pyroute2 keep named namespaces
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2
NFT_CTX_DEFAULT = 0
LIBNFTABLES = "libnftables.so.1"

_libc = ctypes.CDLL(None, use_errno=True)
_dir_shared = threading.Lock()
_dir_ready = False
# One ruleset at a time in this process (about a millisecond each): contexts are
# separate, but libnftables keeps some state process-wide (its bignum library's
# setup, the parser's), and its documentation promises no more.
_nft_lock = threading.Lock()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def on_thread(work: Callable[[], T]) -> T:
    """``work()`` on a new thread, which ends with it (and with any namespace it entered)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="netns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _share_dir() -> None:
    """Make /run/netns a shared mount point, as ip(8) does, so namespaces bound
    there are seen from every mount namespace (once per process)."""
    global _dir_ready
    with _dir_shared:
        if _dir_ready:
            return
        NETNS_DIR.mkdir(parents=True, exist_ok=True)
        path = bytes(NETNS_DIR)
        if _libc.mount(b"", path, b"none", MS_SHARED | MS_REC, None) != 0:
            _check(_libc.mount(path, path, b"none", MS_BIND | MS_REC, None), "mount /run/netns")
            _check(_libc.mount(b"", path, b"none", MS_SHARED | MS_REC, None), "share /run/netns")
        _dir_ready = True


def create(name: str) -> None:
    """A new network namespace, bound at /run/netns/``name`` (which must not exist)."""
    _share_dir()
    path = NETNS_DIR / name
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))

    def make() -> None:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        _check(
            _libc.mount(b"/proc/thread-self/ns/net", bytes(path), b"none", MS_BIND, None),
            f"binding namespace {name}",
        )

    try:
        on_thread(make)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def remove(name: str) -> None:
    """Unbind and forget namespace ``name`` (it ends once nothing is in it); gone: nothing."""
    path = NETNS_DIR / name
    if path.exists():
        _libc.umount2(bytes(path), MNT_DETACH)
        path.unlink(missing_ok=True)


def run_inside(name: str, work: Callable[[], T]) -> T:
    """``work()`` on a thread inside namespace ``name``."""
    path = NETNS_DIR / name

    def entered() -> T:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), f"setns({path})")
        finally:
            os.close(fd)
        return work()

    return on_thread(entered)


def write_sysctl(path: str, value: str) -> None:
    """Write a /proc/sys file (a /proc/sys/net one is the calling thread's namespace's)."""
    with open(path, "w") as f:
        f.write(value)


@functools.cache
def _nftables() -> Any:
    lib = ctypes.CDLL(LIBNFTABLES)
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lib


def nftables_problem() -> str | None:
    """Why rulesets cannot be loaded here, or None."""
    try:
        _nftables()
    except OSError as exc:
        return f"{LIBNFTABLES} cannot be loaded (Debian package 'libnftables1'): {exc}"
    return None


def load_ruleset(ruleset: str, where: str) -> None:
    """Load ``ruleset`` whole, atomically, into the calling thread's namespace."""
    lib = _nftables()
    with _nft_lock:
        _load(lib, ruleset, where)


def _load(lib: Any, ruleset: str, where: str) -> None:
    ctx = lib.nft_ctx_new(NFT_CTX_DEFAULT)
    if not ctx:
        raise VMError(f"nftables could not start for {where}")
    try:
        lib.nft_ctx_buffer_output(ctx)  # nothing printed on the daemon's stdout
        lib.nft_ctx_buffer_error(ctx)
        if lib.nft_run_cmd_from_buffer(ctx, ruleset.encode()) != 0:
            said = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip()
            raise VMError(f"nftables refused the rules for {where}: {said}")
    finally:
        lib.nft_ctx_free(ctx)
