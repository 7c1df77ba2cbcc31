"""Staying beneath the target directory: names checked, paths walked by descriptor.

What :mod:`forkd.archive.unpack` asks before it does anything with an entry, and
after: an entry's name as components beneath the root (:func:`split_name`), a
symlink's target as written (:func:`link_problem`), a directory beneath the root
reached one component at a time without following a symlink (:func:`walk`), and
a symlink resolved once more through the links as they now stand
(:func:`check_resolves_inside`). Standard library only: the guest agent imports
it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from forkd.archive.errors import UnsafeEntry, shown

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINK_HOPS = 40  # symlinks followed resolving one path, as Linux allows

# ---------------------------------------------------------------------- names


def split_name(name: str) -> tuple[str, ...]:
    """An entry's name as components beneath the root; UnsafeEntry for one that is
    absolute, climbs with '..', or holds a NUL."""
    if "\0" in name:
        raise UnsafeEntry(f"refusing entry {shown(name)}: its name holds a NUL byte")
    if name.startswith("/"):
        raise UnsafeEntry(f"refusing entry {shown(name)}: an absolute name")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise UnsafeEntry(f"refusing entry {shown(name)}: its name climbs with '..'")
    return parts


def link_problem(parent: tuple[str, ...], target: str) -> str | None:
    """Why a relative symlink target, read from the link's directory ``parent``, might
    lead outside the tree; None when it cannot. Its ``..`` must all come first, and
    no more of them than ``parent`` is deep: they then climb through the link's own
    directories (real ones: nothing here replaces a directory that holds an entry) and
    the names after them only descend, through links that obey the same rule, however
    later archives change the tree. A ``..`` after a name could climb out of a link
    that a later archive puts at that name (``a/b/../..`` once ``a`` -> ``.``)."""
    climbs = 0
    named = False
    for part in target.split("/"):
        if part == "..":
            if named:
                return "its target climbs with '..' after a name"
            climbs += 1
        elif part not in ("", "."):
            named = True
    if climbs > len(parent):
        return "it points outside the directory"
    return None


# ---------------------------------------------------------------------- directories to walk


def walk(root: int, parts: tuple[str, ...], name: str, create: bool) -> int:
    """A descriptor of the directory ``parts`` beneath ``root`` (``root`` itself for
    none: close it only when it is not), made where missing when ``create``;
    UnsafeEntry, naming entry ``name``, where a component is a symlink or not a
    directory, or (not ``create``) missing."""
    fd = root
    try:
        for part in parts:
            nxt = _open_dir(fd, part, name, create)
            if fd != root:
                os.close(fd)
            fd = nxt
    except BaseException:
        if fd != root:
            os.close(fd)
        raise
    return fd


def _open_dir(fd: int, part: str, name: str, create: bool) -> int:
    try:
        return os.open(part, DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise UnsafeEntry(
                f"refusing entry {shown(name)}: it links to a path that does not exist"
            ) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            # O_DIRECTORY | O_NOFOLLOW on a symlink says ENOTDIR: look again.
            what = "a symlink" if _is_symlink(fd, part) else "a file"
            raise UnsafeEntry(
                f"refusing entry {shown(name)}: {shown(part)} on its path is {what}, "
                "not a directory"
            ) from None
        raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(part, 0o700, dir_fd=fd)
    return os.open(part, DIR_FLAGS, dir_fd=fd)


def _is_symlink(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------------- symlinks made


def readlink(root: int, parts: tuple[str, ...], name: str) -> str | None:
    """The target of the symlink at ``parts`` beneath ``root`` (its directories walked
    without following any, as entry ``name``); None once a later entry put something
    else there."""
    fd = walk(root, parts[:-1], name, False)
    try:
        if not stat.S_ISLNK(os.lstat(parts[-1], dir_fd=fd).st_mode):
            return None
        return os.readlink(parts[-1], dir_fd=fd)
    finally:
        if fd != root:
            os.close(fd)


def check_resolves_inside(root: int, parts: tuple[str, ...]) -> None:
    """Follow the symlink at ``parts`` through the tree as it now stands; refuse it
    if it leads above the root (one component at a time, never by the kernel)."""
    link = readlink(root, parts, "/".join(parts))
    if link is None:
        return
    # The link's own directories are resolved like its target's components.
    link_parts = [p for p in link.split("/") if p not in ("", ".")]
    pending = list(reversed([*parts[:-1], *link_parts]))
    stack: list[str] = []
    hops = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if not stack:
                raise UnsafeEntry(
                    f"refusing symlink {shown('/'.join(parts))}: through the links "
                    "around it, it leads outside the directory"
                )
            stack.pop()
            continue
        try:
            st = os.lstat("/".join([*stack, part]), dir_fd=root)
        except (FileNotFoundError, NotADirectoryError):
            # Nothing there: the rest resolves to nothing, wherever it names.
            return
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_LINK_HOPS:
                return  # a loop: the kernel refuses to follow it (ELOOP)
            target = os.readlink("/".join([*stack, part]), dir_fd=root)
            if target.startswith("/"):
                raise UnsafeEntry(
                    f"refusing symlink {shown('/'.join(parts))}: it leads to an absolute path"
                )
            pending.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
            continue
        stack.append(part)
