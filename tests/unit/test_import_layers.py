"""The rooms of docs/architecture.md and their doors, enforced.

Every ``forkd`` module belongs to one room; a room may import only the rooms its
row names (and itself). An import inside a function counts (it is still a
dependency); one under ``if TYPE_CHECKING:`` does not (nothing runs it). The
third-party packages the SDK, the untrusted-archive extractor and the guest
agent may use are listed too: the first runs in users' programs, the other two
where only the standard library is.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
FORKD = SRC / "forkd"
AGENT_FILES = FORKD / "guest" / "files"

BASE = "base"  # errors, limits, states, paths, hosttools, accel, the version
VMM_PARTS = ("qemu", "jail", "agent", "snapshot", "volumes")

# room -> the rooms it may import besides itself. The order is the architecture's,
# from the top (what users run) down (what everything stands on).
# fmt: off
DOORS: dict[str, frozenset[str]] = {
    "forkd": frozenset({"client", BASE}),  # the package: ``from forkd import Sandbox``
    "cli": frozenset({"client", "mcp_server", "controller", "gateway", "demo", "doctor",
                      "guest", "image_import", "oci", "archive", "vmm.jail", "egress", BASE}),
    "demo": frozenset({"client", "launcher", BASE}),
    "launcher": frozenset({"client", BASE}),
    "mcp_server": frozenset({"client", BASE}),
    "client": frozenset({"archive", BASE}),
    "gateway": frozenset({"controller", BASE}),  # its middleware only: see GATEWAY_USES
    "controller": frozenset({"vmm", *(f"vmm.{part}" for part in VMM_PARTS), "guest",
                             "image_import", "oci", "archive", "egress", BASE}),
    "egress": frozenset({"vmm.jail", BASE}),  # the egress proxy: namespaces, policies
    "doctor": frozenset({"guest", "vmm.qemu", "vmm.jail", BASE}),
    "image_import": frozenset({"oci", "archive", BASE}),
    "oci": frozenset({"vmm.snapshot", "vmm.qemu", "vmm.volumes", BASE}),
    # The image builder asks which snapshots and VMs use an image before deleting it:
    # see GUEST_USES.
    "guest": frozenset({"image_import", "vmm", "vmm.snapshot", BASE}),
    "vmm": frozenset({*(f"vmm.{part}" for part in VMM_PARTS), BASE}),
    "vmm.snapshot": frozenset({"vmm.qemu", "vmm.volumes", BASE}),
    "vmm.agent": frozenset({"vmm.qemu", "vmm.jail", BASE}),
    "vmm.qemu": frozenset({"vmm.jail", "vmm.volumes", BASE}),
    "vmm.volumes": frozenset({"vmm.jail", "archive", BASE}),
    "vmm.jail": frozenset({"archive", BASE}),
    "archive": frozenset(),  # the guest agent runs it too: nothing of forkd's
    BASE: frozenset(),
}
# fmt: on

# The daemon's modules the gateway reuses; nothing else of the daemon.
GATEWAY_USES = frozenset(
    {
        "forkd.controller.middleware",
        "forkd.controller.http_errors",
        "forkd.controller.connection_limits",
        "forkd.controller.server",
    }
)

# What of forkd.vmm the image builder reads; nothing that runs a VM.
GUEST_USES = frozenset({"forkd.vmm.runtime_meta", "forkd.vmm.snapshot.files"})

# The daemon's HTTP side holds no VM: only its services do.
HTTP_SIDE = frozenset(
    {
        "forkd.controller.routes",
        "forkd.controller.pty_ws",
        "forkd.controller.bodies",
        "forkd.controller.port_proxy",
        "forkd.controller.port_ws",
    }
)

# Third-party packages a room may import (absent: any the project depends on).
THIRD_PARTY: dict[str, frozenset[str]] = {
    "client": frozenset({"httpx", "httpx_sse", "httpx_ws", "wsproto"}),  # wsproto: httpx-ws's
    "archive": frozenset(),
    BASE: frozenset(),
}


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "forkd"
    if parts[1] in {
        "errors",
        "limits",
        "states",
        "paths",
        "hosttools",
        "accel",
        "processes",
        "disk_reserve",
        "import_deadline",
        "file_lock",
        "host_names",
        "token_bucket",
        "agent_wire",
        "agent_wire_entries",
        "wire_shape",
        "e2b_key",
        "tracing",
        "__version__",
    }:
        return BASE
    if parts[1] == "vmm":
        return f"vmm.{parts[2]}" if len(parts) > 2 and parts[2] in VMM_PARTS else "vmm"
    return parts[1]


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


_TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _runtime_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) of every import that runs: not those under ``if TYPE_CHECKING``.
    ``from forkd.x import y`` is module ``forkd.x.y`` when ``y`` is one."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in _TYPE_CHECKING:
            yield from _runtime_imports(ast.Module(body=node.orelse, type_ignores=[]))
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:  # forkd has none: caught
            yield node.lineno, "." * node.level + (node.module or "")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                inner = f"{node.module}.{alias.name}"
                named = _is_module(inner) or node.module == "forkd"  # forkd.__version__
                yield node.lineno, inner if named else node.module
        else:
            yield from _runtime_imports(node)


def _daemon_modules() -> Iterator[Path]:
    for path in sorted(FORKD.rglob("*.py")):
        if AGENT_FILES not in path.parents:
            yield path


def test_every_room_has_a_row() -> None:
    rooms = {room_of(_module_name(p)) for p in _daemon_modules()}
    assert rooms <= set(DOORS), f"rooms with no row in DOORS: {sorted(rooms - set(DOORS))}"


def test_each_room_imports_only_through_its_doors() -> None:
    wrong: list[str] = []
    for path in _daemon_modules():
        module = _module_name(path)
        room = room_of(module)
        for line, target in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if target.startswith("."):
                wrong.append(f"{module}:{line} imports {target} (relative: name the module)")
            if not target.startswith("forkd"):
                continue
            to = room_of(target)
            if room == "guest" and to.startswith("vmm") and target not in GUEST_USES:
                wrong.append(f"{module}:{line} imports {target} (the builder: records only)")
            http_side = any(module == m or module.startswith(f"{m}.") for m in HTTP_SIDE)
            if http_side and to.startswith("vmm"):
                wrong.append(f"{module}:{line} imports {target} (the services hold the VMs)")
            if to != room and to not in DOORS[room]:
                wrong.append(f"{module}:{line} imports {target} ({room} -> {to})")
            if room == "gateway" and to == "controller" and target not in GATEWAY_USES:
                wrong.append(f"{module}:{line} imports {target} (the gateway: middleware only)")
    assert wrong == [], "imports through no door (docs/architecture.md):\n" + "\n".join(wrong)


def test_the_doors_only_lead_down() -> None:
    """No two rooms import each other, however indirectly: the table is a ladder."""
    seen: dict[str, str] = {}  # room -> "open" while visiting, "done" after

    def visit(room: str, path: tuple[str, ...]) -> None:
        if seen.get(room) == "open":
            raise AssertionError("a cycle of rooms: " + " -> ".join((*path, room)))
        if seen.get(room) == "done":
            return
        seen[room] = "open"
        for below in sorted(DOORS[room]):
            visit(below, (*path, room))
        seen[room] = "done"

    for room in DOORS:
        visit(room, ())


def test_services_speak_no_http() -> None:
    wrong = [
        f"{_module_name(path)}:{line} imports {target}"
        for path in sorted((FORKD / "controller" / "services").glob("*.py"))
        for line, target in _runtime_imports(ast.parse(path.read_text(), str(path)))
        if target.split(".")[0] in {"fastapi", "starlette", "uvicorn"}
    ]
    assert wrong == [], "services raise forkd.errors; HTTP is the routes' job:\n" + "\n".join(wrong)


def _third_party(target: str) -> str | None:
    top = target.split(".")[0]
    return None if top in sys.stdlib_module_names or top == "forkd" else top


def test_the_sdk_the_extractor_and_the_base_use_only_their_own_libraries() -> None:
    wrong: list[str] = []
    for path in _daemon_modules():
        module = _module_name(path)
        allowed = THIRD_PARTY.get(room_of(module))
        if allowed is None:
            continue
        for line, target in _runtime_imports(ast.parse(path.read_text(), str(path))):
            package = _third_party(target)
            if package is not None and package not in allowed:
                wrong.append(f"{module}:{line} imports {package}")
    assert wrong == [], "\n".join(wrong)


def test_the_guest_agent_imports_the_standard_library_its_siblings_and_forkds_two() -> None:
    """The agent runs in the guest beside forkd.archive and forkd.agent_wire, and nothing
    else of forkd; the wire module, which the guest imports, the standard library only."""
    siblings = {p.stem for p in AGENT_FILES.glob("*.py")}
    shipped = ("forkd.archive", "forkd.agent_wire")
    wrong: list[str] = []
    for path in sorted(AGENT_FILES.glob("*.py")):
        for line, target in _runtime_imports(ast.parse(path.read_text(), str(path))):
            top = target.split(".")[0]
            ok = top in sys.stdlib_module_names or top in siblings or target.startswith(shipped)
            if not ok:
                wrong.append(f"{path.name}:{line} imports {target}")
    wire = SRC / "forkd" / "agent_wire.py"
    for line, target in _runtime_imports(ast.parse(wire.read_text(), str(wire))):
        if target.split(".")[0] not in sys.stdlib_module_names:
            wrong.append(f"agent_wire.py:{line} imports {target}")
    assert wrong == [], "the guest has only the standard library:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import forkd.controller.app\n", ["forkd.controller.app"]),
        ("from forkd.errors import Invalid, NotFound\n", ["forkd.errors", "forkd.errors"]),
        ("from forkd.vmm import vm, pool\n", ["forkd.vmm.vm", "forkd.vmm.pool"]),
        ("if TYPE_CHECKING:\n    import forkd.vmm.vm\nelse:\n    import os\n", ["os"]),
        ("if not TYPE_CHECKING:\n    import forkd.vmm.vm\n", ["forkd.vmm.vm"]),
        ("from .files import x\n", [".files"]),
        ("def f():\n    from forkd.oci import push\n", ["forkd.oci.push"]),
    ],
    ids=[
        "plain",
        "names",
        "from-package",
        "type-checking",
        "not-type-checking",
        "relative",
        "in-a-function",
    ],
)
def test_the_import_reader_sees_what_runs(source: str, expected: list[str]) -> None:
    assert [m for _, m in _runtime_imports(ast.parse(source))] == expected


def test_a_door_not_in_the_table_is_caught() -> None:
    assert room_of("forkd.vmm.snapshot.writer") == "vmm.snapshot"
    assert "controller" not in DOORS["vmm.snapshot"]
    assert "client" not in DOORS["controller"]  # the daemon never uses its own SDK
