"""The user QEMU drops to: its name, whether it applies here, and QEMU's command line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forkd.errors import Invalid
from forkd.vmm import processes, qemu_user
from forkd.vmm.qemu_argv import SANDBOX, SANDBOX_RUNAS, MachineConfig, RuntimePaths, build_argv
from forkd.vmm.volumes import Attachment


@pytest.fixture(autouse=True)
def restore_choice() -> object:
    yield
    qemu_user.configure(qemu_user.DEFAULT_NAME)


@pytest.mark.parametrize("name", ["root", "", "Bad", "a b", "x;rm -rf /", "-o", "a" * 40])
def test_a_name_that_is_root_or_not_a_user_name_is_refused(name: str) -> None:
    with pytest.raises(Invalid):
        qemu_user.configure(name)


def test_useradd_makes_a_system_user_without_login() -> None:
    argv = qemu_user.create_command("forkd-qemu")
    assert argv[0] == "useradd" and argv[-1] == "forkd-qemu"
    assert {"--system", "--no-create-home"} <= set(argv)
    assert argv[argv.index("--shell") + 1] == "/usr/sbin/nologin"


def test_turned_off_there_is_no_drop() -> None:
    qemu_user.configure(None)
    user, why = qemu_user.current()
    assert user is None and "--qemu-user none" in why
    assert qemu_user.runas() is None
    assert qemu_user.qemu_uids() == {os.geteuid()}


def test_a_missing_user_is_named_with_how_to_create_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    qemu_user.configure("forkd-no-such-user")
    user, why = qemu_user.current()
    assert user is None
    assert "does not exist" in why and "useradd" in why


def test_an_existing_user_is_dropped_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    qemu_user.configure("nobody")  # exists on every Debian system
    user, _ = qemu_user.current()
    assert user is not None and user.uid != 0
    assert qemu_user.runas() == "nobody"
    assert qemu_user.qemu_uids() == {0, user.uid}


def test_runas_keeps_the_filter_without_the_setuid_ban_and_writable_layers_come_as_fds() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    cfg = MachineConfig(256, 1, "tcg", Path("/k"), Path("/i"), Path("/r"))
    vols = [Attachment("ro", "/ro", True, ("/v/ro/base.img",)),
            Attachment("rw", "/rw", False, ("/v/rw/layers/a.qcow2", "/v/rw/base.img"))]  # fmt: skip
    argv = build_argv(cfg, rt, ram_file=rt.ram, incoming=True, volumes=vols,
                      runas="forkd-qemu", layer_fds={1: (7, 8)})  # fmt: skip
    assert argv[argv.index("-runas") + 1] == "forkd-qemu"
    assert argv[argv.index("-sandbox") + 1] == SANDBOX_RUNAS
    assert "elevateprivileges" not in SANDBOX_RUNAS and "spawn=deny" in SANDBOX_RUNAS
    joined = " ".join(argv)
    assert "file=/v/ro/base.img," in joined  # read-only: opened once, by name
    assert "-add-fd fd=7,set=2,opaque=ro -add-fd fd=8,set=2,opaque=rw" in joined
    assert "file=/dev/fdset/2,format=qcow2" in joined and "a.qcow2" not in joined
    plain = build_argv(cfg, rt, ram_file=rt.ram, incoming=True)
    assert "-runas" not in plain and plain[plain.index("-sandbox") + 1] == SANDBOX


def test_a_process_owner_is_its_real_uid_not_the_owner_of_its_proc_directory() -> None:
    assert processes.owner_uid(os.getpid()) == os.getuid()
    assert processes.owner_uid(2**22 + 12345) is None  # no such process
