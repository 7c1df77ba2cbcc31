"""The unprivileged user QEMU runs as.

A daemon running as root starts each QEMU as root, so that it can open what
the VM needs (the snapshot's RAM file, the volume layers, the tap device in
the VM's namespace); QEMU then drops to this user (``-runas``) before the
guest runs. Files QEMU must open later (a snapshot's device state, a new
volume layer) are opened by the daemon and handed over as descriptors
(:mod:`forkd.vmm.qmp_channel`), so the user needs no access to any forkd
directory.

The user is a host property, like the seccomp probe in
:mod:`forkd.vmm.launch`: one choice per process, set by the daemon's
``--qemu-user`` (:func:`configure`). A daemon that is not root starts QEMU as
its own user and there is nothing to drop.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
from dataclasses import dataclass

from forkd import hosttools
from forkd.errors import ForkdError, Invalid

log = logging.getLogger(__name__)

DEFAULT_NAME = "forkd-qemu"
NAME_PATTERN = re.compile(r"[a-z_][a-z0-9_-]{0,30}")
NOLOGIN_SHELL = "/usr/sbin/nologin"

_wanted: str | None = DEFAULT_NAME


@dataclass(frozen=True)
class QemuUser:
    name: str
    uid: int
    gid: int


def check_name(name: str) -> str:
    """A user name fit for ``useradd`` and ``-runas``; :class:`Invalid` otherwise."""
    if not NAME_PATTERN.fullmatch(name) or name == "root":
        raise Invalid(f"--qemu-user must be an unprivileged user's name, not {name!r}")
    return name


def configure(name: str | None) -> None:
    """This process's choice: QEMU drops to ``name``; None: QEMU keeps the daemon's user."""
    global _wanted
    _wanted = None if name is None else check_name(name)


def create_command(name: str) -> list[str]:
    """``useradd`` for a system user with no home, no login and a group of its own."""
    return ["useradd", "--system", "--user-group", "--no-create-home",
            "--home-dir", "/nonexistent", "--shell", NOLOGIN_SHELL, check_name(name)]  # fmt: skip


def lookup(name: str) -> QemuUser | None:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    if entry.pw_uid == 0:
        raise Invalid(f"--qemu-user {name!r} is root")
    return QemuUser(name, entry.pw_uid, entry.pw_gid)


def ensure(name: str) -> QemuUser:
    """The user, created first when it is missing (needs root)."""
    found = lookup(name)
    if found is not None:
        return found
    log.warning("creating the system user %s for QEMU", name)
    hosttools.run(create_command(name), what=f"creating the system user {name}")
    found = lookup(name)
    if found is None:
        raise ForkdError(f"useradd reported success but user {name} does not exist")
    return found


def current() -> tuple[QemuUser | None, str]:
    """Whom QEMU drops to in this process (None: no drop), and why, for ``doctor``."""
    if _wanted is None:
        return None, "turned off (--qemu-user none): QEMU keeps the daemon's user"
    if os.geteuid() != 0:
        return None, f"the daemon is not root: QEMU runs as its user (uid {os.geteuid()})"
    user = lookup(_wanted)
    if user is None:
        return None, (
            f"user {_wanted} does not exist, so QEMU runs as root: create it with "
            f"`{' '.join(create_command(_wanted))}` or start the daemon once as root"
        )
    return user, f"QEMU drops to {user.name} (uid {user.uid}) before the guest runs"


def runas() -> str | None:
    """The ``-runas`` value for a QEMU started now, or None."""
    user, _ = current()
    return user.name if user is not None else None


def qemu_uids() -> set[int]:
    """The uids a QEMU this daemon started may run as."""
    user = current()[0]
    return {os.geteuid()} | ({user.uid} if user is not None else set())
