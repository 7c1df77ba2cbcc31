"""FakeVM and FakeDriver (tests/unit/fakes.py) against the real :class:`forkd.vmm.vm.VM`,
without QEMU: the fakes cannot drift from what they stand for.

Every member the services use on a VM is on both, every call they make binds to
both signatures, and every method a fake defines has the real one's shape (no
parameter, default or kind of its own). The services' uses are read from their
source: the members of the names they hold a VM under (``vm``, ``template``) in
the services, the fork pool and live snapshots, and of its guest (``vm.guest.exec``,
checked against the real VM's :class:`forkd.vmm.agent.ops.Guest`; the fake plays its
own guest).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from forkd.vmm.qemu.argv import MachineConfig, RuntimePaths
from forkd.vmm.vm import VM
from tests.unit.fakes import FakeDriver, FakeVM, GuestContents

SRC = Path(__file__).resolve().parents[2] / "src" / "forkd"
# Where VMs are handed around: the services, and the fork pool and live snapshots they use.
VM_USERS = [
    *sorted((SRC / "controller" / "services").glob("*.py")),
    SRC / "vmm" / "pool.py",
    SRC / "vmm" / "snapshot" / "live.py",
]
VM_VARIABLES = frozenset({"vm", "template"})  # the names a VM is held under there


@dataclass(frozen=True)
class Call:
    """A call of a VM's member: ``vm.name(<positional> args, keywords...)``."""

    name: str
    positional: int
    keywords: frozenset[str]
    where: str


def _held_vm(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in VM_VARIABLES


def _vm_members(node: ast.AST) -> Iterator[tuple[ast.Attribute, str]]:
    """Each ``vm.name`` (as ``name``) and ``vm.guest.name`` (as ``guest.name``) under
    ``node``."""
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Attribute) or sub.attr.startswith("_"):
            continue
        if _held_vm(sub.value):
            yield sub, sub.attr
        elif (
            isinstance(sub.value, ast.Attribute)
            and sub.value.attr == "guest"
            and _held_vm(sub.value.value)
        ):
            yield sub, f"guest.{sub.attr}"


def _member(owner: object, dotted: str) -> Any:
    """``owner``'s member by its dotted name (``guest.exec``); AttributeError if none."""
    for part in dotted.split("."):
        owner = getattr(owner, part)
    return owner


def _has(owner: object, dotted: str) -> bool:
    try:
        _member(owner, dotted)
    except AttributeError:
        return False
    return True


def _service_uses() -> tuple[dict[str, list[str]], list[Call]]:
    """Each VM member the services use → where; and each plain call they make of one
    (calls with ``*args`` or ``**kw`` cannot be bound here and are left out)."""
    members: dict[str, list[str]] = {}
    calls: list[Call] = []
    for path in VM_USERS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for attr, name in _vm_members(tree):
            members.setdefault(name, []).append(f"{path.name}:{attr.lineno}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if next(_vm_members(node.func), (None, None))[0] is not node.func:
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords
            ):
                continue
            keywords = frozenset(k.arg for k in node.keywords if k.arg is not None)
            where = f"{path.name}:{node.lineno}"
            name = next(_vm_members(node.func))[1]
            calls.append(Call(name, len(node.args), keywords, where))
    return members, calls


@pytest.fixture
def vms(tmp_path: Path) -> tuple[VM, FakeVM]:
    """A real VM object (no QEMU behind it: nothing here starts or calls one) and a fake."""
    machine = MachineConfig(256, 1, "tcg", Path("/k"), Path("/i"), Path("/r"))
    ram = tmp_path / "ram.bin"
    ram.write_bytes(b"\0")
    real = VM("sb-c", RuntimePaths(tmp_path / "real"), machine, ram, None, None, None, 0)
    return real, FakeVM("sb-c", machine, tmp_path / "fake", GuestContents())


def _shape_problems(real: inspect.Signature, fake: inspect.Signature) -> list[str]:
    """Where ``fake`` accepts a call ``real`` refuses or reads it differently: a
    parameter of its own, another kind or default, optional where the real one is
    required, or another positional order. A real optional parameter the fake lacks
    is allowed (the calls test tells whether anyone passes it)."""
    problems = []
    absorbs = {p.kind for p in fake.parameters.values()}
    for param in fake.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        twin = real.parameters.get(param.name)
        if twin is None:
            problems.append(f"takes {param.name!r}, which the real one does not")
        elif twin.kind != param.kind:
            problems.append(
                f"{param.name!r} is {param.kind.description}, really {twin.kind.description}"
            )
        elif twin.default is twin.empty and param.default is not param.empty:
            problems.append(f"{param.name!r} is optional, really required")
        elif twin.default is not twin.empty and param.default != twin.default:
            problems.append(
                f"{param.name!r} defaults to {param.default!r}, really {twin.default!r}"
            )
    for param in real.parameters.values():
        required = param.default is param.empty and param.kind not in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        )
        if required and param.name not in fake.parameters and param.VAR_KEYWORD not in absorbs:
            problems.append(f"lacks the required {param.name!r}")
    positional = [p.name for p in fake.parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    real_positional = [
        p.name for p in real.parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD
    ]
    if positional != real_positional[: len(positional)]:
        problems.append(f"positional order {positional}, really {real_positional}")
    return problems


def _public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and callable(member)
    }


# ----------------------------------------------------------------------------- the services' uses


def test_the_scan_finds_what_the_services_use_of_a_vm() -> None:
    members, calls = _service_uses()
    assert {
        "id",
        "state",
        "is_alive",
        "pause",
        "resume",
        "begin_snapshot",
        "guest.proc_read",
        "guest.exec",
        "guest.upload_write",
    } <= set(members)
    assert any(c.name == "guest.proc_read" and "wait_s" in c.keywords for c in calls)


def test_every_member_the_services_use_is_on_the_vm_and_the_fake(vms: tuple[VM, FakeVM]) -> None:
    real, fake = vms
    members, _ = _service_uses()
    problems = []
    for name, places in sorted(members.items()):
        where = f"{name} (used at {places[0]})"
        if not _has(real, name) or not _has(fake, name):
            problems.append(f"{where}: on the VM {_has(real, name)}, the fake {_has(fake, name)}")
            continue
        mine, theirs = _member(fake, name), _member(real, name)
        if callable(theirs) != callable(mine):
            problems.append(
                f"{where}: callable on the VM {callable(theirs)}, the fake {callable(mine)}"
            )
        elif inspect.iscoroutinefunction(theirs) != inspect.iscoroutinefunction(mine):
            problems.append(f"{where}: async on the VM, not on the fake, or the other way")
    assert problems == []


def test_every_call_the_services_make_binds_to_the_vm_and_the_fake(
    vms: tuple[VM, FakeVM],
) -> None:
    real, fake = vms
    _, calls = _service_uses()
    problems = []
    for call in calls:
        args, kwargs = [None] * call.positional, dict.fromkeys(call.keywords)
        for owner, vm in (("VM", real), ("FakeVM", fake)):
            try:
                inspect.signature(_member(vm, call.name)).bind(*args, **kwargs)
            except TypeError as exc:
                problems.append(f"{call.where}: {call.name} on {owner}: {exc}")
    assert problems == []


# ----------------------------------------------------------------------------- the fakes' own shape


def test_every_method_the_fake_vm_defines_has_the_real_ones_shape(vms: tuple[VM, FakeVM]) -> None:
    """A fake's method is the VM's, or its guest's (the fake plays its own guest)."""
    real, fake = vms
    problems = []
    for name in _public_methods(FakeVM):
        owner = real if hasattr(real, name) else real.guest
        if not hasattr(owner, name):
            problems.append(f"{name}: neither the VM nor its guest has one")
            continue
        theirs, mine = getattr(owner, name), getattr(fake, name)
        if inspect.iscoroutinefunction(theirs) != inspect.iscoroutinefunction(mine):
            problems.append(f"{name}: async on one of them only")
        problems += [
            f"{name}: {p}"
            for p in _shape_problems(inspect.signature(theirs), inspect.signature(mine))
        ]
    assert problems == []


def test_every_constructor_the_fake_driver_has_is_the_vms_in_shape() -> None:
    """FakeDriver stands where VM's constructors (class methods) stand."""
    driver = FakeDriver()
    problems = []
    for name in _public_methods(FakeDriver):
        theirs = getattr(VM, name, None)
        if theirs is None:
            problems.append(f"{name}: VM has no such constructor")
            continue
        mine = getattr(driver, name)
        if inspect.iscoroutinefunction(theirs) != inspect.iscoroutinefunction(mine):
            problems.append(f"{name}: async on one of them only")
        problems += [
            f"{name}: {p}"
            for p in _shape_problems(inspect.signature(theirs), inspect.signature(mine))
        ]
    assert problems == []
