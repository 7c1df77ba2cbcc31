"""Manifests of what sandboxes changed, read from a guest, and their comparison.

A manifest (the agent's ``fs_manifest_open``, forkd_fsdiff.py) lists what a
sandbox's overlay upper layer holds under a path: each entry's type, size,
mode, mtime and link target. Two sandboxes of one image see, at a path, either
their own upper entry or the image's: :func:`compare` works out both views and
says what changed between them, given what the image holds at the paths only
one side lists (:func:`one_sided`; the agent's ``fs_lower_stat``).

Files are compared by type, size, mode, mtime (ns) and link target, as rsync's
quick check does: a write changes the mtime, a fork keeps it. A directory is
modified only when its mode is. A directory that comes or goes is one change,
its content is not listed.

A manifest is the guest's answer, so it is hostile input: :class:`ManifestReader`
takes it line by line with bounds on the lines, the entries and the bytes, and an
entry that is not exactly the expected shape ends the read with an error.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from forkd.errors import GuestError

EntryKind = Literal["file", "dir", "symlink", "other"]
KINDS: dict[str, EntryKind] = {"f": "file", "d": "dir", "l": "symlink", "o": "other"}
ABSENT = "-"
RECORD_FIELDS = 6
_FIND_TIME = re.compile(rb"(-?[0-9]{1,20})\.([0-9]{1,10})")
# find's %y letters (and the agent's "-"): f, d and l as they are, the rest "other".
# A character device is other unless the agent's record says it is a whiteout.
RECORD_KINDS = {
    b"f": "f",
    b"d": "d",
    b"l": "l",
    b"-": ABSENT,
    **{k.encode(): "o" for k in "cbpsDU?"},
}
MAX_LINE_BYTES = 16 << 10  # a path of 4 KiB and a link target of 4 KiB, JSON-escaped
Change = Literal["added", "modified", "removed"]


@dataclass(frozen=True)
class Stat:
    kind: str  # f, d, l, o, or "-" (absent)
    size: int
    mode: int
    mtime_ns: int
    target: str | None

    @property
    def present(self) -> bool:
        return self.kind != ABSENT

    def same_as(self, other: Stat) -> bool:
        if self.kind != other.kind:
            return False
        if self.kind == "d":
            return self.mode == other.mode
        return (self.size, self.mode, self.mtime_ns, self.target) == (
            other.size,
            other.mode,
            other.mtime_ns,
            other.target,
        )


@dataclass
class Manifest:
    path: str
    entries: dict[str, Stat]
    truncated: bool = False
    lower_root: str | None = None  # where the guest reaches the image's files

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "truncated": self.truncated,
            "entries": [[p, *stat_json(e)] for p, e in self.entries.items()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        reader = ManifestReader(str(data["path"]), max_entries=len(data["entries"]))
        for raw in data["entries"]:
            reader.add(raw)
        return reader.manifest(truncated=bool(data.get("truncated")))


@dataclass(frozen=True)
class Difference:
    path: str
    change: Change
    kind: EntryKind
    size: int
    mode: int


class ManifestReader:
    """Takes a manifest's lines as they arrive, within bounds."""

    def __init__(self, path: str, max_entries: int) -> None:
        self.path = path
        self.max_entries = max_entries
        self.entries: dict[str, Stat] = {}
        self.ended: dict[str, Any] | None = None
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """The next bytes of the stream; :class:`GuestError` when they are not a manifest."""
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE_BYTES:
            raise GuestError(f"the guest's manifest has a line over {MAX_LINE_BYTES} bytes")
        for line in lines:
            if line.strip():
                self._line(line)

    def _line(self, line: bytes) -> None:
        if self.ended is not None:
            raise GuestError("the guest's manifest goes on after its end")
        if len(line) > MAX_LINE_BYTES:
            raise GuestError(f"the guest's manifest has a line over {MAX_LINE_BYTES} bytes")
        try:
            raw = json.loads(line)
        except ValueError:
            raise GuestError("the guest's manifest has a line that is not JSON") from None
        if isinstance(raw, dict):
            if raw.get("end") is not True:
                raise GuestError("the guest's manifest has an object that is not its end")
            self.ended = raw
            return
        self.add(raw)

    def add(self, raw: Any) -> None:
        if len(self.entries) >= self.max_entries:
            raise GuestError(f"the guest's manifest has over {self.max_entries} entries")
        path, upper = _entry(raw)
        if not _under(path, self.path):
            raise GuestError(f"the guest's manifest names {path[:200]!r}, not under {self.path!r}")
        self.entries[path] = upper

    def manifest(self, truncated: bool | None = None, lower_root: str | None = None) -> Manifest:
        if truncated is None:
            if self.ended is None or self._partial.strip():
                raise GuestError("the guest's manifest ended before its end line")
            truncated = bool(self.ended.get("truncated"))
        return Manifest(self.path, self.entries, truncated, lower_root)


class RecordReader(ManifestReader):
    """Takes a manifest in the agent's ``records`` format (GNU find's output and the
    agent's own records of the same shape, forkd_fsfind.py): six NUL-ended fields per
    entry (kind, size, octal mode, mtime as seconds.fraction, path relative to the
    asked one, link target), then ``E`` and the JSON end object. A later record of a
    path takes the place of an earlier one (a whiteout's of find's device)."""

    def __init__(self, path: str, max_entries: int) -> None:
        super().__init__(path, max_entries)
        self._fields: list[bytes] = []
        self._base = "" if path == "/" else path.rstrip("/")

    def feed(self, data: bytes) -> None:
        fields = (self._partial + data).split(b"\0")
        self._partial = fields.pop()
        if len(self._partial) > MAX_LINE_BYTES:
            raise GuestError(f"the guest's manifest has a field over {MAX_LINE_BYTES} bytes")
        pending = self._fields
        pending += fields
        at = 0
        while len(pending) - at >= 2:
            if self.ended is not None:
                raise GuestError("the guest's manifest goes on after its end")
            if pending[at] == b"E":
                self._end(pending[at + 1])
                at += 2
            elif len(pending) - at >= RECORD_FIELDS:
                self._record(pending[at : at + RECORD_FIELDS])
                at += RECORD_FIELDS
            else:
                break
        del pending[:at]

    def _end(self, raw: bytes) -> None:
        if len(raw) > MAX_LINE_BYTES:
            raise GuestError(f"the guest's manifest has an end over {MAX_LINE_BYTES} bytes")
        try:
            end = json.loads(raw)
        except ValueError:
            raise GuestError("the guest's manifest has an end that is not JSON") from None
        if not isinstance(end, dict) or end.get("end") is not True:
            raise GuestError("the guest's manifest has an end that is not its end")
        self.ended = end

    def _record(self, fields: list[bytes]) -> None:
        kind, size, mode, mtime, rel, target = fields
        if any(len(f) > MAX_LINE_BYTES for f in fields):
            raise GuestError(f"the guest's manifest has a field over {MAX_LINE_BYTES} bytes")
        name = rel.decode("utf-8", "surrogateescape")
        path = f"{self._base}/{name}" if name else self.path
        ours = RECORD_KINDS.get(kind)
        try:
            if ours is None or not (size.isdigit() and mode.isdigit()):
                raise ValueError
            when = _FIND_TIME.fullmatch(mtime)
            if when is None or len(size) > 20 or len(mode) > 7:
                raise ValueError
            # find prints tv_sec, then tv_nsec: -1.5 s is "-2.5000000000"
            mtime_ns = int(when[1]) * 1_000_000_000 + int(when[2].ljust(9, b"0")[:9])
            link = target.decode("utf-8", "surrogateescape") if ours == "l" else None
            if ours != "l" and target:
                raise ValueError
            raw = [path, ours, int(size) if ours in "fl" else 0, int(mode, 8), mtime_ns, link]
        except ValueError:
            raise GuestError("the guest's manifest has an entry of the wrong shape") from None
        if path in self.entries:  # the agent's own record of it (a whiteout), after find's
            del self.entries[path]
        self.add(raw)

    def manifest(self, truncated: bool | None = None, lower_root: str | None = None) -> Manifest:
        if truncated is None and self._fields:
            raise GuestError("the guest's manifest ended within an entry")
        return super().manifest(truncated, lower_root)


def reader_for(fmt: Any, path: str, max_entries: int) -> ManifestReader:
    """The reader of a manifest in the agent's format ``fmt`` (``lines``, the default of
    agents before ``records``, or ``records``)."""
    if fmt in (None, "lines"):
        return ManifestReader(path, max_entries)
    if fmt == "records":
        return RecordReader(path, max_entries)
    raise GuestError(f"the guest agent's manifest is in an unknown format {str(fmt)[:40]!r}")


def _entry(raw: Any) -> tuple[str, Stat]:
    if not (isinstance(raw, list) and len(raw) == 6 and isinstance(raw[0], str)):
        raise GuestError("the guest's manifest has an entry of the wrong shape")
    path = raw[0]
    if not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise GuestError("the guest's manifest has a path that is not absolute")
    if posixpath.normpath(path) != path and path != "/":
        raise GuestError(f"the guest's manifest names {path[:200]!r}, not under a normal path")
    return path, stat_of(raw[1:6])


def stat_of(raw: Any) -> Stat:
    """Five fields of the guest's (kind, size, mode, mtime_ns, link target) as a Stat;
    :class:`GuestError` unless they are exactly that."""
    ok = (
        isinstance(raw, list)
        and len(raw) == 5
        and raw[0] in (*KINDS, ABSENT)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in raw[1:4])
        and raw[1] >= 0
        and raw[2] >= 0  # an mtime before 1970 is negative
        and (raw[4] is None or (isinstance(raw[4], str) and len(raw[4]) <= 4096))
    )
    if not ok:
        raise GuestError("the guest's manifest has an entry of the wrong shape")
    return Stat(raw[0], raw[1], raw[2], raw[3], raw[4])


def stat_json(stat: Stat) -> list[Any]:
    return [stat.kind, stat.size, stat.mode, stat.mtime_ns, stat.target]


def _under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def hidden_below(manifest: Manifest, ordered: Iterable[str]) -> set[str]:
    """Those of ``ordered`` (sorted paths, ``manifest``'s among them) that an ancestor
    hides: one ``manifest`` lists as absent or as no directory. In sorted order the
    paths under a prefix come together, so one pass with a stack of the hiding
    ancestors does it, whatever the paths' depth (a check of every ancestor of every
    path cost the square of the depth: a guest's 2048-deep paths held the loop)."""
    hidden: set[str] = set()
    # Hiding entries not themselves hidden, each with its trailing '/' (what its
    # descendants start with). A name may sort between an entry and its descendants
    # ("/a b" between "/a" and "/a/x"): an entry leaves only once a path sorts past
    # its subtree, and such a name, below it, may hide a subtree of its own first.
    hiding: list[str] = []
    for path in ordered:
        while hiding and path > hiding[-1] and not path.startswith(hiding[-1]):
            hiding.pop()
        if hiding and path.startswith(hiding[-1]):
            hidden.add(path)
            continue
        entry = manifest.entries.get(path)
        if entry is not None and entry.kind != "d" and path != "/":
            hiding.append(path + "/")
    return hidden


def view(entry: Stat | None, hidden: bool, image: Stat | None) -> Stat | None:
    """What a sandbox sees at a path: its manifest's own ``entry`` there, or the image's
    (``image``) unless an ancestor in its manifest hides it (``hidden``)."""
    if entry is not None:
        return entry if entry.present else None
    if hidden:
        return None
    return image if image is not None and image.present else None


def one_sided(base: Manifest, target: Manifest) -> list[str]:
    """The paths only one side lists: where the other sees the image's file."""
    return sorted(base.entries.keys() ^ target.entries.keys())


def compare(
    base: Manifest, target: Manifest, image: Mapping[str, Stat | None]
) -> Iterator[Difference]:
    """What changed from ``base`` to ``target`` (of the same image), path by path;
    ``image``: what the image holds at each path of :func:`one_sided`."""
    ordered = sorted(base.entries.keys() | target.entries.keys())
    hidden_before, hidden_after = hidden_below(base, ordered), hidden_below(target, ordered)
    for path in ordered:
        below = image.get(path)
        before = view(base.entries.get(path), path in hidden_before, below)
        after = view(target.entries.get(path), path in hidden_after, below)
        if before is None and after is None:
            continue
        if before is None:
            assert after is not None
            yield Difference(path, "added", KINDS[after.kind], after.size, after.mode)
        elif after is None:
            yield Difference(path, "removed", KINDS[before.kind], before.size, before.mode)
        elif not before.same_as(after):
            yield Difference(path, "modified", KINDS[after.kind], after.size, after.mode)
