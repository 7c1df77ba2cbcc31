"""The runtime disk an imported container image boots with: forkd's guest pieces and a
Python of forkd's own for the agent, mounted at /opt/forkd beside the image's tree.

The image is the sandbox's root and may have no Python, or a libc other than
glibc, or another glibc: the agent uses nothing of it. ``/opt/forkd/python``
starts the runtime's interpreter through the runtime's own dynamic loader, with
the runtime's libraries only (``--inhibit-cache``: not the image's
``ld.so.cache``) and in isolated mode without ``site`` (no ``PYTHON*`` variable
and no file of the image's reaches it). The loader's options are not
inherited: the programs the agent starts are the image's own, run as the image
would run them.

One runtime serves every imported image: ``<cache>/runtime/runtime-<key>.sqfs``,
``key`` hashing its inputs (the Debian base it takes Python from, forkd's guest
files), built once and hard-linked into each image's directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from forkd import hosttools
from forkd.errors import ImageError
from forkd.guest import guest_files, rootfs

RUNTIME_VERSION = 2  # 2: readable by an image's own user
LIBDIR = "usr/lib/x86_64-linux-gnu"
LOADER = f"{LIBDIR}/ld-linux-x86-64.so.2"
MOUNT = "/opt/forkd"  # where stage 1 mounts the runtime in the guest
# Of the base's /usr, what the runtime keeps: the shared libraries (the loader and
# whatever an extension module may load) and the interpreter with its library.
KEEP = ("./usr/lib/x86_64-linux-gnu", "./usr/bin", "./usr/lib/python3*")
DROP = ("perl-base", "perl5", "gconv")  # in LIBDIR: nothing the agent's Python loads


def key(base_key: str) -> str:
    """The runtime's key: the base it takes Python from, forkd's guest files, busybox."""
    h = hashlib.sha256(f"runtime={RUNTIME_VERSION}\nbase={base_key}\n".encode())
    guest_files.digest(h, guest_files.OPT_FILES)
    h.update(hashlib.sha256(hosttools.require_static_busybox().read_bytes()).digest())
    return h.hexdigest()[:16]


def build(
    base_tar: Path, base_key: str, cache: Path, say: Callable[[str], None] = lambda _m: None
) -> Path:
    """The runtime disk for ``base_tar`` (a Debian tree with python3), built unless it is."""
    out = cache / "runtime" / f"runtime-{key(base_key)}.sqfs"
    if out.is_file():
        return out
    hosttools.require("mksquashfs")
    out.parent.mkdir(parents=True, exist_ok=True)
    say("assembling the runtime disk (forkd's agent and its Python)")
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=".staging-runtime-"))
    try:
        tree = work / "tree"
        _fill(tree, base_tar, work)
        partial = work / out.name
        hosttools.run(
            [
                "mksquashfs",
                str(tree),
                str(partial),
                "-comp",
                "lz4",
                "-noappend",
                "-quiet",
                "-all-root",
            ],
            what="mksquashfs (runtime)",
        )
        os.replace(partial, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _fill(tree: Path, base_tar: Path, work: Path) -> None:
    """The runtime's tree: forkd's guest pieces, the Python wrapper, ``rt/`` from the base."""
    rt = tree / "rt"
    rt.mkdir(parents=True)
    hosttools.run(  # the base is forkd's own mmdebstrap output, not a user's archive
        ["tar", "-x", "--numeric-owner", "--wildcards", "-f", str(base_tar), "-C", str(rt), *KEEP],
        what="unpacking Python from the base root filesystem",
    )
    for name in DROP:
        shutil.rmtree(rt / LIBDIR / name, ignore_errors=True)
    pythons = sorted(p.name for p in (rt / "usr" / "bin").glob("python3.*") if p.is_file())
    if not pythons or not (rt / LOADER).is_file():
        raise ImageError(f"the base {base_tar.name} has no python3 and loader to run the agent")
    for extra in (rt / "usr" / "bin").iterdir():  # only the interpreter is started
        if extra.name != pythons[-1]:
            extra.unlink()
    rootfs.install_agent(tree)
    wrapper = tree / "python"
    wrapper.write_text(_wrapper(pythons[-1]))
    wrapper.chmod(0o755)
    for sub in ("mnt/lower", "mnt/rw"):  # stage 1 moves its mounts here
        (tree / sub).mkdir(parents=True)
    readable_by_all(tree)


def readable_by_all(tree: Path) -> None:
    """Every directory of ``tree`` searchable and every file readable by every user, an
    executable executable by all, nothing writable but by its owner: the runtime is
    forkd's code, no secret, and an image's own user (``USER 1234``, ``USER postgres``)
    runs its eval worker. (The daemon's umask, 077, made them 0700 and 0600: eval and
    warm-up failed in every image with a non-root ``USER``.)"""
    for here, _dirs, files in os.walk(tree):
        os.chmod(here, 0o755)
        for name in files:
            path = Path(here) / name
            if path.is_symlink():
                continue
            mode = path.stat().st_mode & 0o777
            path.chmod(0o755 if mode & 0o100 else 0o644)


def _wrapper(python: str) -> str:
    usr = f"{MOUNT}/rt/usr"
    return (
        f"#!{MOUNT}/busybox sh\n"
        "# forkd's Python for its agent: its own loader and libraries, isolated mode, no site.\n"
        f"exec {MOUNT}/rt/{LOADER} --inhibit-cache --library-path {usr}/lib/x86_64-linux-gnu \\\n"
        f'    {usr}/bin/{python} -I -S "$@"\n'
    )
