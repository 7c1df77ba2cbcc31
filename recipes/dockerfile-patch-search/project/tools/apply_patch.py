"""Apply a unified diff (``git diff`` or ``diff -u`` output) to the files under the
current directory, with the standard library only: the image need not have
``patch`` or ``git``. Every hunk's context must match exactly (at its line or
at a small offset); if any hunk of any file does not apply, no file is changed.

Usage: python3 tools/apply_patch.py CHANGE.diff
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
MAX_OFFSET = 20  # lines a hunk may have moved since the diff was made


class PatchError(Exception):
    pass


def target(header: str) -> Path:
    """The file a ``+++ b/path`` line names, checked to stay under the current directory."""
    name = header[4:].split("\t")[0].strip()
    name = name[2:] if name.startswith(("a/", "b/")) else name
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not name:
        raise PatchError(f"refusing to patch {name!r}: not a path under the project")
    return path


def parse(text: str) -> dict[Path, list[tuple[int, list[str], list[str]]]]:
    """Each file's hunks: (old start line, old lines, new lines)."""
    files: dict[Path, list[tuple[int, list[str], list[str]]]] = {}
    lines = text.splitlines(keepends=True)
    i = 0
    current: Path | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            current = target(line)
            files.setdefault(current, [])
        elif (m := HUNK.match(line)) and current is not None:
            old_count = int(m.group(2) or 1)
            new_count = int(m.group(4) or 1)
            old: list[str] = []
            new: list[str] = []
            i += 1
            while (len(old) < old_count or len(new) < new_count) and i < len(lines):
                body, kind = lines[i][1:], lines[i][:1]
                if kind == " " or lines[i] in ("\n", "\r\n"):  # an editor may strip the space
                    old.append(body or lines[i])
                    new.append(body or lines[i])
                elif kind == "-":
                    old.append(body)
                elif kind == "+":
                    new.append(body)
                elif kind != "\\":  # "\ No newline at end of file"
                    raise PatchError(f"line {i + 1}: not part of a hunk: {lines[i]!r}")
                i += 1
            files[current].append((int(m.group(1)), old, new))
            continue
        i += 1
    if not files:
        raise PatchError("no file changes found in the patch")
    return files


def apply(lines: list[str], hunks: list[tuple[int, list[str], list[str]]], name: Path) -> list[str]:
    out = list(lines)
    shift = 0  # how far earlier hunks moved the lines below them
    for number, (start, old, new) in enumerate(hunks, 1):
        at = max(start - 1, 0) + shift
        for offset in sorted(range(-MAX_OFFSET, MAX_OFFSET + 1), key=abs):
            if at + offset >= 0 and out[at + offset : at + offset + len(old)] == old:
                at += offset
                break
        else:
            raise PatchError(f"{name}: hunk {number} (line {start}) does not apply")
        out[at : at + len(old)] = new
        shift += len(new) - len(old)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        changes = parse(Path(argv[0]).read_text())
        patched = {}
        for path, hunks in changes.items():
            text = path.read_text() if path.exists() else ""
            patched[path] = "".join(apply(text.splitlines(keepends=True), hunks, path))
    except (PatchError, OSError, UnicodeDecodeError) as exc:
        print(f"patch does not apply: {exc}", file=sys.stderr)
        return 1
    for path, text in patched.items():  # only once every hunk of every file applied
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
