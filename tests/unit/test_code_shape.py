"""The shape of forkd's source: no function or file longer than the house style allows.

A function is measured from its first decorator (or its ``def``) to its last
line, nested definitions included; each nested definition is measured too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2] / "src" / "forkd"
MAX_FUNCTION_LINES = 60  # issue 38: no function over 60 lines (issue 25 said 80)
MAX_FILE_LINES = 500  # issue 38: a module holds one noun; the guest agent's own files aside
GUEST_OWN = "guest/files/"  # run in the guest as one directory of modules

_Function = ast.FunctionDef | ast.AsyncFunctionDef


def _function_lengths(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Every function under ``tree`` by qualified name (``Class.method``,
    ``outer.inner``) → its length in lines."""
    lengths: dict[str, int] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, _Function | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if isinstance(node, _Function):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert node.end_lineno is not None
                lengths[name] = node.end_lineno - first + 1
            lengths.update(_function_lengths(node, f"{name}."))
        else:
            lengths.update(_function_lengths(node, prefix))  # defs inside if/try/with
    return lengths


def _all_lengths() -> dict[str, int]:
    """``path/under/forkd.py::qualname`` → lines, for every function in src/forkd."""
    lengths: dict[str, int] = {}
    for path in sorted(SOURCE_ROOT.rglob("*.py")):
        module = path.relative_to(SOURCE_ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, count in _function_lengths(tree).items():
            lengths[f"{module}::{name}"] = count
    return lengths


def _too_long(lengths: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}


def test_no_function_is_longer_than_60_lines() -> None:
    offenders = _too_long(_all_lengths())
    assert offenders == {}, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers): "
        + ", ".join(
            f"src/forkd/{name} ({count} lines)" for name, count in sorted(offenders.items())
        )
    )


def test_no_file_is_longer_than_500_lines() -> None:
    long = {}
    for path in sorted(SOURCE_ROOT.rglob("*.py")):
        module = path.relative_to(SOURCE_ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES and not module.startswith(GUEST_OWN):
            long[module] = lines
    assert long == {}, (
        f"files over {MAX_FILE_LINES} lines (split them by what they hold): "
        + ", ".join(f"src/forkd/{name} ({count} lines)" for name, count in sorted(long.items()))
    )


def test_the_measure_counts_decorators_and_nested_definitions() -> None:
    source = (
        "@decorator\n"
        "@other(1)\n"
        "def outer():\n"
        "    def inner():\n"
        "        pass\n"
        "    return inner\n"
        "\n"
        "class Box:\n"
        "    if True:\n"
        "        async def method(self):\n"
        "            return 1\n"
    )
    assert _function_lengths(ast.parse(source)) == {
        "outer": 6,
        "outer.inner": 2,
        "Box.method": 2,
    }


# Words of forkd.states' enums: a state compared with one of them as a string is a
# typo mypy cannot see (``row.state == "runing"``). A Literal (a workspace's status)
# mypy checks itself; QEMU's run state is read as its ``running`` flag, not a word.
_STATE_WORDS = {
    "starting",
    "running",
    "paused",
    "hibernated",
    "dead",
    "incoming",
    "warm",
    "writing",
    "ready",
    "failed",
}


def _names_a_state(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in ("state", "status")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        args = node.args
        return (
            node.func.attr == "get"
            and bool(args)
            and isinstance(args[0], ast.Constant)
            and args[0].value in ("state", "status")
        )
    return isinstance(node, ast.Name) and node.id in ("state", "was")


def _string_words(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & _STATE_WORDS
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_string_words(e) for e in node.elts))
    return set()


def test_no_state_is_compared_with_a_string() -> None:
    found = []
    for path in sorted(SOURCE_ROOT.rglob("*.py")):
        module = path.relative_to(SOURCE_ROOT).as_posix()
        if module.startswith(GUEST_OWN):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Compare)
                and _names_a_state(node.left)
                and any(_string_words(c) for c in node.comparators)
            ):
                found.append(f"src/forkd/{module}:{node.lineno}")
    assert found == [], "compare with forkd.states' members, not strings: " + ", ".join(found)
