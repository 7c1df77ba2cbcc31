"""An image's merged tree: each name's node, and a layer's entries applied to it.

:func:`forkd.image_import.layers.read_layers` hands each layer's entries to
:meth:`Tree.apply` one by one, bottom layer first. The tree holds names and
metadata; a regular file's content is copied into its layer's data file, and the
node says where it lies there (runs of zeros a whole chunk long are not copied but
kept as holes).

The rules are Docker's (OCI image-spec ``layer.md``, as moby and containerd apply it):

- ``./`` prefixes, empty components and leading ``/`` are dropped: a container
  runtime confines an absolute name to the image's root, and so does this. A name
  that climbs with ``..`` is refused (:class:`UnsafeEntry`).
- ``.wh.NAME`` deletes NAME and what lies beneath it; ``.wh..wh..opq`` hides every
  child of its directory. Either applies only to what LOWER layers put there:
  entries of the same layer stay, wherever the marker sits in the tar. Entries at
  the root named ``.wh..wh.*`` are AUFS metadata and skipped, as Docker does.
- A later entry replaces an earlier one of the same path: a directory over a
  directory keeps the children and takes the new metadata; anything else replaces
  the old entry and its subtree. Missing parents are made 0755 root:root, dated 0,
  for a whiteout or an opaque marker too.
- A layer is applied as Docker and containerd apply it: unpacked apart from the
  layers below, then merged by overlayfs. So where an entry's parent is a symlink,
  a file or anything but a directory that a LOWER layer made, it is covered by a
  new directory (0755 root:root), never followed: ``lib/x`` over a lower ``lib ->
  usr/lib`` makes ``/lib`` a directory holding ``x``. A symlink the same layer made
  is followed inside the image's root: absolute targets start at the root, ``..``
  stops at the root, at most :data:`MAX_LINK_HOPS` links per name (a loop is
  :class:`BadArchive`). The last component is never followed.
- A hard link shares its target's inode (so a later layer that whites out or
  replaces the first name leaves the link's content as it was); its target must
  already be a non-directory in the tree, or the layer is :class:`BadArchive`.
- Extended attributes other than ``security.capability`` and ``user.*`` are
  dropped, as forkd.archive's ROOTFS policy drops them.

The result is the root ``docker export`` shows (tests/unit/test_image_vs_docker.py
compares them field by field, for Dockerfile builds and hand-made layers), but
where Docker is not deterministic or refuses: a parent a layer does not name
keeps a lower directory's owner, mode and time (containerd's way; Docker's
overlay2 driver shows it 0755 root:root) and a made parent is dated 0 (Docker and
containerd date it when they unpack); a whiteout after its layer's own entry of
that name and a hard link to a lower layer's file, which both refuse, are applied
as the OCI layer spec reads. Times outside squashfs's range are
:mod:`forkd.image_import.squash`'s to clamp.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO

from forkd.archive.beneath import MAX_LINK_HOPS
from forkd.archive.errors import ArchiveTooLarge, BadArchive, UnsafeEntry, shown
from forkd.archive.tar_format import Kind, Limits, Member, TarReader
from forkd.archive.unpack import ROOTFS_XATTR_PREFIXES

CHUNK = 256 << 10  # a file's content is copied, and checked for zeros, this much at a time
MAX_ZERO_HOLES = 4096  # holes made of zero chunks in one file (a sparse map stays small)
NAME_MAX = 255  # bytes in one component, as Linux and squashfs allow
MAX_DEV_MAJOR = (1 << 12) - 1
MAX_DEV_MINOR = (1 << 20) - 1
MAX_ID = (1 << 32) - 2  # uid/gid; (1 << 32) - 1 is "no owner"
# Names in one directory of the merged image. tar2sqfs looks each new name up in a
# list of its directory's names, so a directory costs the square of its size: measured
# here, 30,000 names in one directory took 6 s and 60,000 took 28 s, and the 1,000,000
# the image may hold would take hours. At this cap a directory costs under 40 s.
MAX_DIR_ENTRIES = 65_536
OPAQUE = ".wh..wh..opq"
WHITEOUT = ".wh."
AUFS_META = ".wh..wh."
_ZERO_CHUNK = bytes(CHUNK)


class Node:
    """One name in the tree. A directory, file, symlink, device or fifo is its own
    inode; a hard link is a name whose ``extra`` is the inode it shares. What
    ``extra`` holds depends on the kind: read it through that kind's accessor
    (:attr:`children`, :meth:`inode`, :attr:`target`, :attr:`device`, :attr:`runs`)."""

    __slots__ = (
        "extra",
        "gid",
        "kind",
        "layer",
        "mode",
        "mtime",
        "offset",
        "size",
        "uid",
        "xattrs",
    )

    def __init__(
        self, kind: Kind, layer: int, mode: int = 0o755, uid: int = 0, gid: int = 0, mtime: int = 0
    ) -> None:
        self.kind = kind
        self.layer = layer  # the layer that wrote this name (-1: made implicitly before any)
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.mtime = mtime
        self.xattrs: dict[str, bytes] | None = None
        # DIRECTORY: dict of children; SYMLINK: target; devices: (major, minor);
        # FILE: the data runs (offset in file, length) when sparse, else None;
        # HARDLINK: the Node of the inode it names.
        self.extra: dict[str, Node] | str | tuple[int, int] | list[tuple[int, int]] | Node | None
        self.extra = {} if kind is Kind.DIRECTORY else None
        self.size = 0  # a file's apparent size
        self.offset = 0  # where a file's stored content starts in its layer's data file

    @property
    def children(self) -> dict[str, Node]:
        """A directory's names."""
        if not isinstance(self.extra, dict):
            raise TypeError(f"a {self.kind.value} has no children")
        return self.extra

    def inode(self) -> Node:
        """The inode this name is: a hard link's target, any other node itself."""
        if self.kind is not Kind.HARDLINK:
            return self
        if not isinstance(self.extra, Node):
            raise TypeError("a hard link without the inode it names")
        return self.extra

    @property
    def target(self) -> str:
        """A symlink's target."""
        if not isinstance(self.extra, str):
            raise TypeError(f"a {self.kind.value} has no link target")
        return self.extra

    @property
    def device(self) -> tuple[int, int]:
        """A device's (major, minor)."""
        if not isinstance(self.extra, tuple):
            raise TypeError(f"a {self.kind.value} has no device number")
        return self.extra

    @property
    def runs(self) -> list[tuple[int, int]] | None:
        """A sparse file's data runs (offset in the file, length); None when it is dense."""
        if self.kind is not Kind.FILE or not (self.extra is None or isinstance(self.extra, list)):
            raise TypeError(f"a {self.kind.value} has no data runs")
        return self.extra


class Tree:
    """The merged image: its root, and the data files its regular files are read from."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.root = Node(Kind.DIRECTORY, -1)
        self.entries = 0  # names beneath the root
        self.data_paths: list[Path] = []  # one per layer, by index
        self.stored_bytes = 0  # content copied into the data files, all layers
        self.linked: set[Node] = set()  # inodes some hard link names (by identity)
        self._ints: dict[int, int] = {}  # one object per distinct mode, owner and time

    def _int(self, value: int) -> int:
        return self._ints.setdefault(value, value)

    # ------------------------------------------------------------------ resolving

    def resolve_dir(self, parts: Sequence[str], layer: int, create: bool) -> Node | None:
        """The directory ``parts`` names, symlinks followed inside the root; missing ones
        are made (``create``) or end the walk with None. Creating, a non-directory that
        a layer below ``layer`` made is covered by a new directory, and one ``layer``
        made is :class:`BadArchive`; otherwise a non-directory ends the walk with None."""
        pending = list(reversed(parts))
        stack = [self.root]  # the directories walked, for '..'
        hops = 0
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if len(stack) > 1:
                    stack.pop()
                continue
            here = stack[-1]
            child = here.children.get(part)
            if child is None:
                if not create:
                    return None
                if len(stack) > self.limits.max_depth:
                    raise ArchiveTooLarge(
                        f"a path resolves more than {self.limits.max_depth} directories deep"
                    )
                _check_component(part)
                child = Node(Kind.DIRECTORY, layer)
                self._add(here, part, child)
            inode = child.inode()
            if create and inode.kind is not Kind.DIRECTORY and child.layer != layer:
                # The runtimes unpack this layer on its own, where the lower symlink or
                # file is not: overlayfs then shows the directory made there over it.
                child = inode = Node(Kind.DIRECTORY, layer)
                self._add(here, part, child)
            if inode.kind is Kind.SYMLINK:
                hops += 1
                if hops > MAX_LINK_HOPS:
                    raise BadArchive(
                        f"more than {MAX_LINK_HOPS} symbolic links resolving a path "
                        f"(at {shown(part)}, a loop?)"
                    )
                target = inode.target
                if target.startswith("/"):
                    del stack[1:]
                pending.extend(reversed(target.split("/")))
                continue
            if inode.kind is not Kind.DIRECTORY:
                if not create:
                    return None
                raise BadArchive(f"{shown(part)} is used as a directory but is not one")
            if len(stack) > self.limits.max_depth:
                raise ArchiveTooLarge(
                    f"a path resolves more than {self.limits.max_depth} directories deep"
                )
            stack.append(child)
        return stack[-1]

    # ------------------------------------------------------------------ changing

    def _add(self, parent: Node, name: str, node: Node) -> None:
        old = parent.children.get(name)
        if old is not None:
            self._remove(parent, name)
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise ArchiveTooLarge(f"the image has more than {self.limits.max_entries} entries")
        if len(parent.children) >= MAX_DIR_ENTRIES:
            raise ArchiveTooLarge(
                f"a directory holds more than {MAX_DIR_ENTRIES} entries (at {shown(name)})"
            )
        parent.children[name] = node

    def _remove(self, parent: Node, name: str) -> None:
        removed = 0
        todo = [parent.children.pop(name)]
        while todo:
            node = todo.pop()
            removed += 1
            if node.kind is Kind.DIRECTORY:
                todo.extend(node.children.values())
        self.entries -= removed

    def hide_lower(self, parent: Node, name: str, layer: int) -> None:
        """Delete what layers below ``layer`` put at ``parent/name``, keeping what
        ``layer`` itself wrote there (and the directories leading to it)."""
        node = parent.children[name]
        if node.kind is Kind.DIRECTORY:
            for child in list(node.children):
                self.hide_lower(node, child, layer)
            if node.layer == layer or node.children:
                return
        elif node.layer == layer:
            return
        self._remove(parent, name)

    def _meta(self, node: Node, member: Member, layer: int) -> Node:
        node.layer = layer
        node.mode = self._int(member.mode)
        node.uid = self._int(member.uid)
        node.gid = self._int(member.gid)
        node.mtime = self._int(member.mtime)
        kept = {k: v for k, v in member.xattrs.items() if k.startswith(ROOTFS_XATTR_PREFIXES)}
        node.xattrs = kept or None
        return node

    # ------------------------------------------------------------------ one entry

    def apply(self, member: Member, reader: TarReader, layer: int, data: IO[bytes]) -> None:
        """Merge one entry of layer number ``layer`` (its content copied into ``data``)."""
        parts = entry_parts(member.name)
        if member.uid > MAX_ID or member.gid > MAX_ID:
            raise BadArchive(f"entry {shown(member.name)} has an owner out of range")
        if not parts:
            if member.kind is not Kind.DIRECTORY:
                raise BadArchive(
                    f"entry {shown(member.name)} names the root but is not a directory"
                )
            self._meta(self.root, member, layer)
            return
        if parts[0].startswith(AUFS_META) and parts != [OPAQUE]:
            return  # AUFS's own bookkeeping (hard link stash, its metadata), not content
        base = parts[-1]
        if base.startswith(WHITEOUT):
            self._whiteout(member.name, parts[:-1], base, layer)
            return
        parent = self.resolve_dir(parts[:-1], layer, create=True)
        assert parent is not None
        _check_component(base)
        kind = member.kind
        if kind is Kind.DIRECTORY:
            old = parent.children.get(base)
            if old is not None and old.kind is Kind.DIRECTORY:
                self._meta(old, member, layer)
                return
            self._add(parent, base, self._meta(Node(kind, layer), member, layer))
            return
        if kind is Kind.HARDLINK:
            self._add(parent, base, self._hardlink(member, layer))
            return
        node = self._meta(Node(kind, layer), member, layer)
        if kind is Kind.FILE:
            self._store(node, member, reader, data)
        elif kind is Kind.SYMLINK:
            if not member.linkname or "\0" in member.linkname:
                raise BadArchive(f"entry {shown(member.name)} is a symlink with a bad target")
            node.extra = member.linkname
        elif kind in (Kind.CHAR_DEVICE, Kind.BLOCK_DEVICE):
            if member.devmajor > MAX_DEV_MAJOR or member.devminor > MAX_DEV_MINOR:
                raise BadArchive(f"entry {shown(member.name)} has a device number out of range")
            node.extra = (member.devmajor, member.devminor)
        self._add(parent, base, node)

    def _whiteout(self, name: str, dir_parts: list[str], base: str, layer: int) -> None:
        parent = self.resolve_dir(dir_parts, layer, create=True)  # as any entry's
        assert parent is not None
        if base == OPAQUE:
            for child in list(parent.children):
                self.hide_lower(parent, child, layer)
            return
        victim = base[len(WHITEOUT) :]
        if victim in ("", ".", ".."):
            raise UnsafeEntry(f"refusing whiteout {shown(name)}: it names no sibling")
        if victim in parent.children:
            self.hide_lower(parent, victim, layer)

    def _hardlink(self, member: Member, layer: int) -> Node:
        target_parts = entry_parts(member.linkname, link_of=member.name)
        parent = self.resolve_dir(target_parts[:-1], layer, create=False) if target_parts else None
        target = parent.children.get(target_parts[-1]) if parent is not None else None
        if target is None:
            raise BadArchive(
                f"entry {shown(member.name)} is a hard link to {shown(member.linkname)}, "
                "which is not in the image"
            )
        inode = target.inode()
        if inode.kind is Kind.DIRECTORY:
            raise BadArchive(f"entry {shown(member.name)} is a hard link to a directory")
        link = Node(Kind.HARDLINK, layer)
        link.extra = inode
        self.linked.add(inode)
        return link

    def _store(self, node: Node, member: Member, reader: TarReader, data: IO[bytes]) -> None:
        """Copy a file's content into the layer's data file; whole chunks of zeros
        become holes."""
        node.size = member.size
        node.offset = data.tell()
        runs: list[tuple[int, int]] = []
        holes = 0
        for offset, piece in reader.chunks(CHUNK):
            if len(piece) == CHUNK and holes < MAX_ZERO_HOLES and piece == _ZERO_CHUNK:
                holes += 1
                continue
            self.stored_bytes += len(piece)
            if self.stored_bytes > self.limits.max_bytes:
                raise ArchiveTooLarge(
                    f"the layers hold more than {self.limits.max_bytes} bytes of content "
                    f"(at entry {shown(member.name)})"
                )
            data.write(piece)
            if runs and sum(runs[-1]) == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + len(piece))
            else:
                runs.append((offset, len(piece)))
        dense = runs == [(0, member.size)] or (not runs and member.size == 0)
        node.extra = None if dense else runs


# ---------------------------------------------------------------------- names


def entry_parts(name: str, link_of: str = "") -> list[str]:
    """A name (or ``link_of``'s hard link target) as components beneath the image's
    root: leading '/' and './', empty and '.' components dropped (a container runtime
    confines them to the root too); '..' or a NUL is refused."""
    what = f"entry {shown(link_of)}: its hard link target" if link_of else "entry"
    if "\0" in name:
        raise BadArchive(f"refusing {what} {shown(name)}: it holds a NUL byte")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeEntry(f"refusing {what} {shown(name)}: it climbs with '..'")
    return parts


def _check_component(part: str) -> None:
    if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise BadArchive(f"a name component is longer than {NAME_MAX} bytes: {shown(part)}")
