"""The shape of forkd's source: no function longer than the house style allows.

A function is measured from its first decorator (or its ``def``) to its last
line, nested definitions included; each nested definition is measured too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2] / "src" / "forkd"
MAX_FUNCTION_LINES = 80  # issue 25: no function over 80 lines (the house style)

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


def test_no_function_is_longer_than_80_lines() -> None:
    offenders = _too_long(_all_lengths())
    assert offenders == {}, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers): "
        + ", ".join(
            f"src/forkd/{name} ({count} lines)" for name, count in sorted(offenders.items())
        )
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
