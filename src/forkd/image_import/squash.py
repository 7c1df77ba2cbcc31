"""An image's merged layers written as one squashfs root image, through ``tar2sqfs``.

:func:`build_rootfs` is the door: the layers are merged in memory
(:mod:`forkd.image_import.layers` into a :mod:`forkd.image_import.tree`), then the
tree is written as one trusted tar stream, piped straight into ``tar2sqfs``
(Debian's squashfs-tools-ng), never onto the host's file system. The stream is pax:
names in sorted order with every directory before its children, the first name of a
hard-linked inode carrying its content and the others hard links to it, extended
attributes as ``SCHILY.xattr.*`` records (binary values as they are), devices and
fifos, any owner and mode. A sparse file (or one with whole chunks of zeros) is
written in GNU's pax sparse format 0.1 (``GNU.sparse.map``), which tar2sqfs reads,
so its holes cross the pipe as a map, not as zeros; squashfs stores them as sparse
blocks.

squashfs keeps an inode's time as unsigned 32-bit seconds: a time past its last
second (2106-02-07) is written as that second, where Docker shows the time the
layer states, and one before 1970 is 0 (forkd.archive's reader reads it so), as
Docker shows it. An image that states either still imports.

The image is lz4-compressed, as forkd's recipe images are (``mksquashfs -comp
lz4``). Measured on bench/image_layers.py's ~300 MiB image (2 cores): tar2sqfs
writes it in 4.1 s with lz4 against 23 s with zstd (level 15); zstd's image is
half the size, and reading every file back through the host's kernel took
2.8-2.9 s against lz4's 3.1 s. (Debian 12's ``unsquashfs`` 4.5.1 misreads
tar2sqfs's lz4 images whose id table is one tiny block; the kernel and
``rdsquashfs`` read them.) It is written under a temporary name beside ``out``
and renamed into place when whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, NoReturn

from forkd import hosttools
from forkd.archive.errors import ArchiveTooLarge
from forkd.archive.tar_format import Kind, Limits
from forkd.errors import HostToolMissing, ImageError, StorageFull
from forkd.image_import.layers import IMAGE_LIMITS, Progress, read_layers
from forkd.image_import.model import LayerBlob, RootfsStats
from forkd.image_import.tree import Node, Tree

TOOL = "tar2sqfs"
PACKAGE = "squashfs-tools-ng"
COMPRESSOR = "lz4"
DIE_WITH_PARENT = ("--pdeathsig", "KILL")  # setpriv's: set after it changes the uid
MAX_JOBS = 8  # tar2sqfs compressor threads
BLOCK = 512
FLUSH_AT = 1 << 20  # headers and small files are gathered into writes this large
PIPE_SIZE = 1 << 20
_TYPE = {
    Kind.FILE: b"0",
    Kind.HARDLINK: b"1",
    Kind.SYMLINK: b"2",
    Kind.CHAR_DEVICE: b"3",
    Kind.BLOCK_DEVICE: b"4",
    Kind.DIRECTORY: b"5",
    Kind.FIFO: b"6",
}
_OCTAL_MAX = {8: 0o7777777, 12: 0o77777777777}
MAX_TIME = (1 << 32) - 1  # squashfs's last second


def build_rootfs(
    layers: Sequence[LayerBlob],
    out: Path,
    work: Path,
    *,
    limits: Limits = IMAGE_LIMITS,
    progress: Progress | None = None,
    run_as: tuple[int, int] | None = None,
) -> RootfsStats:
    """Flatten ``layers`` (bottom first) into the squashfs image ``out``, using ``work``
    (the caller's, removed by the caller) for scratch. Raises forkd.archive's errors
    for a hostile or broken layer, :class:`HostToolMissing` without tar2sqfs; on any
    failure ``out`` is not created.

    ``run_as`` (uid, gid): tar2sqfs, which parses the image's names and attributes in
    C, runs as that user with no groups, no capability and ``no_new_privs`` (a root
    daemon passes a uid of its own), writing only into a directory of ``work`` it is
    given; the image is handed back to root before it is renamed into place."""
    tool = require_tool()
    tree = read_layers(layers, work, limits, progress)
    jail: _Jail | None = None
    if run_as is not None:
        jail = _Jail(work / "squashfs-out", out.name, *run_as)
        staged = jail.staged
    else:
        staged = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        entries, file_bytes = _write_image(tree, tool, staged, work, progress, jail)
        image_bytes = staged.stat().st_size
        if jail is not None:
            jail.hand_back()
        os.rename(staged, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        raise
    finally:
        if jail is not None:
            jail.close()
    if progress is not None:
        progress(f"squashfs: {entries} entries, {image_bytes / (1 << 20):.0f} MiB")
    return RootfsStats(
        layers=len(layers), entries=entries, file_bytes=file_bytes, image_bytes=image_bytes
    )


def _disk_full(path: Path) -> bool:
    """Whether the filesystem holding ``path`` has (next to) no room left."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 16 << 20


def require_tool() -> str:
    """tar2sqfs's path; :class:`HostToolMissing` naming its package when it is not there."""
    try:
        return hosttools.require(TOOL)
    except HostToolMissing:
        raise HostToolMissing(TOOL, PACKAGE) from None


class _Jail:
    """Where tar2sqfs runs as a uid of its own: a directory of ``work`` it owns, reached
    through a descriptor it inherits (``/proc/self/fd/N``: the directories above are
    root's and closed to it), and the setpriv prefix that drops it there."""

    def __init__(self, directory: Path, name: str, uid: int, gid: int) -> None:
        directory.mkdir(mode=0o700)
        os.chown(directory, uid, gid)
        self.staged = directory / name
        self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.output = f"/proc/self/fd/{self.fd}/{name}"
        self.prefix = [
            hosttools.require("setpriv"),
            f"--reuid={uid}",
            f"--regid={gid}",
            "--clear-groups",
            "--no-new-privs",
            "--bounding-set=-all",
            "--inh-caps=-all",
            *DIE_WITH_PARENT,
            "--",
        ]

    def hand_back(self) -> None:
        """The finished image, the daemon's own (it was the jailed uid's)."""
        fd = os.open(self.staged, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ImageError(f"{TOOL} left something other than a file")
            os.fchown(fd, os.getuid(), os.getgid())
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)

    def close(self) -> None:
        os.close(self.fd)


def _write_image(
    tree: Tree,
    tool: str,
    staged: Path,
    work: Path,
    progress: Progress | None,
    jail: _Jail | None = None,
) -> tuple[int, int]:
    """Run tar2sqfs on the tree's tar stream (in ``jail``, when given); (entries written,
    files' apparent bytes)."""
    output = jail.output if jail is not None else str(staged)
    log = work / "tar2sqfs.log"
    with open(log, "w+b") as log_file:
        proc = subprocess.Popen(
            _tar2sqfs_argv(tool, output, jail),
            stdin=subprocess.PIPE,
            stdout=log_file,
            stderr=log_file,
            close_fds=True,
            pass_fds=(jail.fd,) if jail is not None else (),
        )
        assert proc.stdin is not None
        try:
            counts = _feed(proc.stdin, tree)
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if code != 0 or counts is None:
            _tar2sqfs_failed(log_file, code, staged)
    return counts


def _tar2sqfs_argv(tool: str, output: str, jail: _Jail | None) -> list[str]:
    """tar2sqfs writing ``output`` from the tar stream on its stdin, behind the setpriv
    that jails it (``jail``) or only ties it to its parent."""
    # tar2sqfs dies with the worker that feeds it (the parent-death signal set after the
    # change of uid, which would clear it). Unjailed, without setpriv (util-linux before
    # 2.33), it runs without: the worker's own parent-death signal still ends the import.
    setpriv = shutil.which("setpriv")
    prefix = (
        jail.prefix if jail is not None else ([setpriv, *DIE_WITH_PARENT, "--"] if setpriv else [])
    )
    return [
        *prefix,
        tool,
        "--compressor",
        COMPRESSOR,
        "--no-skip",
        "--quiet",
        "--num-jobs",
        str(max(1, min(MAX_JOBS, os.cpu_count() or 1))),
        output,
    ]


def _feed(stdin: IO[bytes], tree: Tree) -> tuple[int, int] | None:
    """Write the tree's tar stream into tar2sqfs's ``stdin``, then close it; (entries
    written, files' apparent bytes), or None when tar2sqfs stopped reading."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    writer = _TarWriter(stdin.fileno(), tree)
    try:
        return writer.write_all()
    except BrokenPipeError:
        return None  # tar2sqfs stopped reading: its exit status and log say why
    finally:
        writer.close()
        stdin.close()


def _tar2sqfs_failed(log_file: IO[bytes], code: int, staged: Path) -> NoReturn:
    """tar2sqfs failed: StorageFull when the disk is full, else an ImageError with the end
    of its log."""
    log_file.seek(0)
    tail = log_file.read()[-2000:].decode(errors="replace").strip()
    if _disk_full(staged):
        raise StorageFull(f"the image cache's disk is full: {TOOL} could not write")
    raise ImageError(f"{TOOL} failed (exit {code}): {tail or 'it stopped reading'}")


class _TarWriter:
    """The tree as a pax tar stream on a descriptor: small pieces gathered, a large
    file's content sent from its data file by the kernel (sendfile)."""

    def __init__(self, fd: int, tree: Tree) -> None:
        self.fd = fd
        self.tree = tree
        self.buffer = bytearray()
        self.data_fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in tree.data_paths]

    def close(self) -> None:
        for fd in self.data_fds:
            os.close(fd)

    def write_all(self) -> tuple[int, int]:
        linked = self.tree.linked
        first_name: dict[Node, bytes] = {}  # a hard-linked inode -> the name carrying it
        entries = file_bytes = 0
        self._entry(b"./", self.tree.root)
        for path, node in walk(self.tree.root):
            entries += 1
            inode = node.inode()
            if inode in linked:
                seen = first_name.get(inode)
                if seen is not None:
                    self._put(_header(path, b"1", 0o644, 0, 0, 0, 0, seen))
                    continue
                first_name[inode] = path
            if inode.kind is Kind.FILE:
                file_bytes += inode.size
                if file_bytes > self.tree.limits.max_bytes:
                    raise ArchiveTooLarge(
                        f"the image's files add up to more than {self.tree.limits.max_bytes} bytes"
                    )
            self._entry(path, inode)
        self._put(bytes(2 * BLOCK))
        self._flush()
        return entries, file_bytes

    def _entry(self, path: bytes, node: Node) -> None:
        kind = node.kind
        records = [
            (b"SCHILY.xattr." + key.encode("utf-8", "surrogateescape"), value)
            for key, value in (node.xattrs or {}).items()
        ]
        link = b""
        major = minor = stored = 0
        if kind is Kind.SYMLINK:
            link = node.target.encode("utf-8", "surrogateescape")
        elif kind in (Kind.CHAR_DEVICE, Kind.BLOCK_DEVICE):
            major, minor = node.device
        elif kind is Kind.FILE:
            runs = _runs(node)
            stored = sum(length for _, length in runs)
            if node.runs is not None:
                sparse_map = ",".join(f"{o},{n}" for o, n in [*runs, (node.size, 0)])
                records += [
                    (b"GNU.sparse.map", sparse_map.encode()),
                    (b"GNU.sparse.size", str(node.size).encode()),
                ]
        mtime = min(node.mtime, MAX_TIME)
        header = _header(
            path,
            _TYPE[kind],
            node.mode,
            node.uid,
            node.gid,
            mtime,
            stored,
            link,
            major,
            minor,
            records,
        )
        self._put(header)
        if stored:
            self._content(node, stored)

    def _content(self, node: Node, stored: int) -> None:
        fd = self.data_fds[node.layer]
        if stored < FLUSH_AT:
            piece = os.pread(fd, stored, node.offset)
            if len(piece) != stored:
                raise ImageError("a layer's data file is shorter than what was copied into it")
            self._put(piece)
        else:
            self._flush()
            offset, left = node.offset, stored
            while left:
                sent = os.sendfile(self.fd, fd, offset, min(left, 1 << 30))
                if sent == 0:
                    raise ImageError("a layer's data file is shorter than what was copied into it")
                offset += sent
                left -= sent
        self._put(bytes(-stored % BLOCK))

    def _put(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) >= FLUSH_AT:
            self._flush()

    def _flush(self) -> None:
        done = 0
        with memoryview(self.buffer) as view:
            while done < len(view):
                done += os.write(self.fd, view[done:])
        self.buffer.clear()


def walk(root: Node) -> Iterator[tuple[bytes, Node]]:
    """Every name beneath ``root`` as (path, node): names sorted, each directory
    before its children."""
    stack: list[tuple[bytes, dict[str, Node], Iterator[str]]] = [
        (b"", root.children, iter(sorted(root.children)))
    ]
    while stack:
        prefix, children, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        node = children[name]
        path = prefix + name.encode("utf-8", "surrogateescape")
        yield path, node
        if node.kind is Kind.DIRECTORY:
            stack.append((path + b"/", node.children, iter(sorted(node.children))))


def _runs(node: Node) -> list[tuple[int, int]]:
    runs = node.runs
    return [(0, node.size)] if runs is None else runs


# ---------------------------------------------------------------------- tar headers


def _header(
    path: bytes,
    kind: bytes,
    mode: int,
    uid: int,
    gid: int,
    mtime: int,
    size: int,
    link: bytes = b"",
    major: int = 0,
    minor: int = 0,
    records: list[tuple[bytes, bytes]] | None = None,
) -> bytes:
    """A ustar header, preceded by a pax header for what ustar cannot hold."""
    pax = list(records or ())
    if len(path) > 100:
        pax.append((b"path", path))
    if len(link) > 100:
        pax.append((b"linkpath", link))
    for key, value, width in (
        (b"uid", uid, 8),
        (b"gid", gid, 8),
        (b"size", size, 12),
        (b"mtime", mtime, 12),
    ):
        if value > _OCTAL_MAX[width]:
            pax.append((key, str(value).encode()))
    out = b""
    if pax:
        payload = b"".join(_record(key, value) for key, value in pax)
        out = _block(b"././@PaxHeader", b"x", 0o644, 0, 0, 0, len(payload))
        out += payload + bytes(-len(payload) % BLOCK)
    return out + _block(path, kind, mode, uid, gid, mtime, size, link, major, minor)


def _record(key: bytes, value: bytes) -> bytes:
    """``LEN key=value\\n``, LEN counting the whole record, its own digits included."""
    body = len(key) + len(value) + 3  # " ", "=", "\n"
    length = body + len(str(body))
    if len(str(length)) != len(str(body)):
        length += 1
    return b"%d %s=%s\n" % (length, key, value)


def _block(
    path: bytes,
    kind: bytes,
    mode: int,
    uid: int,
    gid: int,
    mtime: int,
    size: int,
    link: bytes = b"",
    major: int = 0,
    minor: int = 0,
) -> bytes:
    block = bytearray(BLOCK)
    block[0:100] = path[:100].ljust(100, b"\0")
    block[100:108] = _octal(mode & 0o7777, 8)
    block[108:116] = _octal(min(uid, _OCTAL_MAX[8]), 8)
    block[116:124] = _octal(min(gid, _OCTAL_MAX[8]), 8)
    block[124:136] = _octal(min(size, _OCTAL_MAX[12]), 12)
    block[136:148] = _octal(min(mtime, _OCTAL_MAX[12]), 12)
    block[148:156] = b" " * 8
    block[156:157] = kind
    block[157:257] = link[:100].ljust(100, b"\0")
    block[257:265] = b"ustar\x0000"
    block[329:337] = _octal(major, 8)
    block[337:345] = _octal(minor, 8)
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)
