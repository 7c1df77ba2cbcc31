"""GET /v1/sandboxes/{id}/diff on the fake driver (its guests' files are their upper
layer, an empty image below): against the snapshot a sandbox was forked from, another
snapshot, another sandbox; as JSON, a patch and a tar; a snapshot read once; bad
requests refused. And the comparison itself, and the reader of a hostile manifest."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkd.client import Controller, ControllerError, Sandbox
from forkd.controller.services.manifests import (
    Manifest,
    ManifestReader,
    Stat,
    compare,
    hidden_below,
    one_sided,
    reader_for,
)
from forkd.errors import GuestError
from tests.unit.conftest import Server


@pytest.fixture
def ctl(server: Server) -> Iterator[Controller]:
    with Controller(server.url, token=server.token) as c:
        c.create_snapshot("py", memory_mib=128)
        yield c


@pytest.fixture
def child(ctl: Controller) -> str:
    """A child of snapshot ``base``, whose guest held /work/{keep,edit,drop}.txt; it
    edits one, removes one and adds one."""
    src = ctl.spawn_sandboxes("py")[0]["id"]
    for name in ("keep", "edit", "drop"):
        ctl.write_file(src, f"/work/{name}.txt", f"{name}\nline 2\n")
    ctl.write_file(src, "/etc/other", b"outside /work")
    ctl.branch_sandbox(src, tag="base")
    ctl.kill_sandbox(src)
    sid = str(ctl.spawn_sandboxes("base")[0]["id"])
    ctl.write_file(sid, "/work/edit.txt", "edit\nline two\n")
    ctl.remove_file(sid, "/work/drop.txt")
    ctl.write_file(sid, "/work/new.txt", "brand new\n")
    return sid


def test_a_diff_lists_what_the_child_changed_since_its_snapshot(
    ctl: Controller, child: str
) -> None:
    res = ctl.diff_sandbox(child, "/work")
    assert res.against == "base" and res.against_kind == "snapshot" and not res.truncated
    assert [(c.path, c.change) for c in res.changes] == [
        ("/work/drop.txt", "removed"),
        ("/work/edit.txt", "modified"),
        ("/work/new.txt", "added"),
    ]
    new = res.changes[2]
    assert (new.kind, new.size, new.mode) == ("file", 10, 0o644)
    assert ctl.diff_sandbox(child, "/etc").changes == []  # only under the path asked
    assert [c.path for c in ctl.diff_sandbox(child).changes] == res.of("removed") + res.of(
        "modified"
    ) + res.of("added")  # the whole tree: the same three


def test_a_snapshot_is_read_once_by_a_child_killed_at_once(
    ctl: Controller, server: Server, child: str
) -> None:
    before = len(server.driver.vms)
    ctl.diff_sandbox(child, "/work")
    forked = len(server.driver.vms) - before
    assert forked == 1  # one child of "base", for its manifest
    assert [s["id"] for s in ctl.list_sandboxes()] == [child]  # and it is gone
    ctl.diff_sandbox(child, "/work")
    assert len(server.driver.vms) - before == 1  # kept beside the snapshot: no fork


def test_a_patch_shows_the_text_changes(ctl: Controller, child: str) -> None:
    patch = ctl.diff_patch(child, "/work")
    assert "--- a/edit.txt\n+++ b/edit.txt\n" in patch
    assert "-line 2\n+line two\n" in patch
    assert "--- /dev/null\n+++ b/new.txt\n" in patch and "+brand new\n" in patch
    assert "--- a/drop.txt\n+++ /dev/null\n" in patch and "-drop\n" in patch
    assert "keep.txt" not in patch


def test_binary_and_large_files_are_named_not_shown(ctl: Controller, child: str) -> None:
    ctl.write_file(child, "/work/blob.bin", b"\x00\x01\x02")
    ctl.write_file(child, "/work/big.txt", b"x" * (600 << 10))
    patch = ctl.diff_patch(child, "/work")
    assert "Binary files /dev/null and b/blob.bin differ\n" in patch
    assert "Files /dev/null and b/big.txt differ (over 524288 bytes" in patch


def test_a_tar_holds_the_added_and_modified_files(ctl: Controller, child: str) -> None:
    data = ctl.diff_tar(child, "/work")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
    assert got == {"work/edit.txt": b"edit\nline two\n", "work/new.txt": b"brand new\n"}


def test_against_another_sandbox_and_another_snapshot(ctl: Controller, child: str) -> None:
    sibling = str(ctl.spawn_sandboxes("base")[0]["id"])
    ctl.write_file(sibling, "/work/sibling.txt", "mine")
    res = ctl.diff_sandbox(child, "/work", against=sibling)
    assert res.against_kind == "sandbox"
    assert [(c.path, c.change) for c in res.changes] == [
        ("/work/drop.txt", "removed"),
        ("/work/edit.txt", "modified"),
        ("/work/new.txt", "added"),
        ("/work/sibling.txt", "removed"),
    ]
    res = ctl.diff_sandbox(child, "/work", against="py")  # the template: no /work at all
    assert {(c.path, c.change) for c in res.changes} == {
        ("/work/keep.txt", "added"),
        ("/work/edit.txt", "added"),
        ("/work/new.txt", "added"),
    }


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"path": "work"}, 400),
        ({"format": "zip"}, 400),
        ({"against": "no-such"}, 404),
    ],
    ids=["relative-path", "bad-format", "unknown-against"],
)
def test_bad_requests_are_refused(
    server: Server, child: str, params: dict[str, Any], status: int
) -> None:
    resp = httpx.get(
        f"{server.url}/v1/sandboxes/{child}/diff",
        params=params,
        headers={"Authorization": f"Bearer {server.token}"},
    )
    assert resp.status_code == status, resp.text


def test_a_paused_sandbox_is_woken_and_an_unknown_one_refused(ctl: Controller, child: str) -> None:
    ctl.pause_sandbox(child)
    ctl.diff_sandbox(child, "/work")
    assert ctl.get_sandbox(child)["state"] == "running"  # tests/unit/test_waking.py
    with pytest.raises(ControllerError) as exc:
        ctl.diff_sandbox("sb-none", "/work")
    assert exc.value.status == 404


# ------------------------------------------------------------ the comparison


def _stat(kind: str, size: int = 1, mtime: int = 1, mode: int = 0o644) -> Stat:
    return Stat(kind, size, mode, mtime, None)


def _manifest(path: str, **entries: Stat) -> Manifest:
    return Manifest(path, {p.replace("_", "/"): e for p, e in entries.items()})


def _compared(base: Manifest, target: Manifest, image: dict[str, Stat]) -> list[tuple[str, ...]]:
    known = {p: image.get(p) for p in one_sided(base, target)}  # what the agent is asked
    return [(d.path, d.change, d.kind) for d in compare(base, target, known)]


def test_compare_takes_the_image_where_a_side_has_no_entry() -> None:
    image = {"/a": _stat("f", 5, 100), "/b": _stat("f", 5, 100), "/c": _stat("f", 5, 100)}
    base = _manifest("/", _a=_stat("f", 5, 200))  # base rewrote /a
    target = _manifest(
        "/",
        _b=_stat("-"),  # the target removed the image's /b
        _c=_stat("f", 5, 100),  # copied up, unchanged: the same as the image's
        _d=_stat("d"),  # a new directory
    )
    assert _compared(base, target, image) == [
        ("/a", "modified", "file"),
        ("/b", "removed", "file"),
        ("/d", "added", "dir"),
    ]


def test_compare_hides_what_is_under_a_removed_directory() -> None:
    base = _manifest("/", _w_x=_stat("f"))
    target = _manifest("/", _w=_stat("-"))
    got = _compared(base, target, {"/w": _stat("d")})
    assert [(p, c) for p, c, _ in got] == [("/w", "removed"), ("/w/x", "removed")]


def test_a_hiding_ancestor_hides_only_its_own_subtree() -> None:
    # "/w x" and "/wx" sort among "/w"'s descendants' neighbours: neither is under it.
    image = {p: _stat("f") for p in ("/w/y", "/w/z/deep", "/w x", "/wx")}
    target = _manifest("/", _w=_stat("f", 7))  # a file where the image has a directory
    base = Manifest("/", {p: _stat("f", 2) for p in image})  # base rewrote all four
    got = {(p, c) for p, c, _ in _compared(base, target, image | {"/w": _stat("d")})}
    assert got == {
        ("/w", "modified"),
        ("/w/y", "removed"),
        ("/w/z/deep", "removed"),
        ("/w x", "modified"),
        ("/wx", "modified"),
    }


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.lists(st.sampled_from(["a", "b", "a b", "a.b"]), min_size=1, max_size=4).map(
            lambda parts: "/" + "/".join(parts)
        ),
        st.sampled_from(["d", "f", "-"]),
    )
)
def test_hidden_paths_are_those_under_a_listed_non_directory(kinds: dict[str, str]) -> None:
    manifest = Manifest("/", {p: _stat(k) for p, k in kinds.items()})
    ordered = sorted(kinds)
    naive = {
        p for p in ordered if any(p.startswith(a + "/") and k != "d" for a, k in kinds.items())
    }
    assert hidden_below(manifest, ordered) == naive


@pytest.mark.timeout(60)  # the per-ancestor check took ~100 s; this takes well under 1
def test_deep_paths_cost_the_comparison_little() -> None:
    """A hostile guest's manifest of 4000 paths 2048 directories deep (each within the
    4096-byte path limit): the comparison is linear in them, not in their square."""
    deep = "/a" * 2046
    base = Manifest("/", {f"{deep}/f{i}": _stat("f", 1) for i in range(4000)})
    target = Manifest("/", {})  # each looked up in the image, unless an ancestor hides it
    assert len(list(compare(base, target, {}))) == 4000


def test_directories_differ_by_mode_only() -> None:
    base = _manifest("/", _d=_stat("d", 0, 1))
    assert _compared(base, _manifest("/", _d=_stat("d", 0, 99)), {}) == []
    changed = _manifest("/", _d=_stat("d", 0, 99, mode=0o700))
    assert [c for _, c, _ in _compared(base, changed, {})] == ["modified"]


# ------------------------------------------------------------ a hostile manifest


def _lines(*items: Any) -> bytes:
    return b"".join(json.dumps(i).encode() + b"\n" for i in items)


END = {"end": True, "truncated": False, "entries": 1}
GOOD = ["/w/a", "f", 3, 420, 7, None]


def test_the_reader_takes_a_manifest_in_any_pieces() -> None:
    reader = ManifestReader("/w", 10)
    data = _lines(GOOD, END)
    for i in range(0, len(data), 3):
        reader.feed(data[i : i + 3])
    manifest = reader.manifest()
    assert list(manifest.entries) == ["/w/a"] and not manifest.truncated


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (_lines(["/w/a", "f", 3, 420]), "wrong shape"),
        (_lines(["/w/a", "f", -3, 420, 7, None]), "wrong shape"),
        (_lines(["/w/a", "f", True, 420, 7, None]), "wrong shape"),
        (_lines(["/w/a", "x", 3, 420, 7, None]), "wrong shape"),
        (_lines(["/w/a", "f", 3, 420, 7, None, None]), "wrong shape"),
        (_lines(["/etc/passwd", "f", 3, 420, 7, None]), "not under"),
        (_lines(["/w/../../etc", "f", 3, 420, 7, None]), "not under"),
        (_lines(["w/a", "f", 3, 420, 7, None]), "not absolute"),
        (_lines(*([f"/w/{i}", *GOOD[1:]] for i in range(3))), "over 2 entries"),
        (b"[" * 20000, "over 16384 bytes"),
        (b"not json\n", "not JSON"),
        (_lines({"hello": 1}), "not its end"),
        (_lines(END, GOOD), "after its end"),
    ],
    ids=lambda v: v.replace(" ", "-") if isinstance(v, str) else None,
)
def test_the_reader_refuses_what_is_not_a_manifest(data: bytes, says: str) -> None:
    reader = ManifestReader("/w", 2)
    with pytest.raises(GuestError, match=says):
        reader.feed(data)
        reader.manifest()


def test_a_manifest_cut_before_its_end_is_refused() -> None:
    reader = ManifestReader("/w", 10)
    reader.feed(_lines(GOOD))
    with pytest.raises(GuestError, match="ended before its end"):
        reader.manifest()


def _records(*records: list[str], end: dict[str, Any] | None = None) -> bytes:
    """The agent's ``records`` format: six NUL-ended fields each, then E and the end."""
    out = b"".join(
        b"".join(f.encode("utf-8", "surrogateescape") + b"\0" for f in r) for r in records
    )
    return out + b"E\0" + json.dumps(END if end is None else end).encode() + b"\0"


RECORD = ["f", "3", "644", "7.0000000090", "a", ""]


def test_the_record_reader_takes_find_s_output_in_any_pieces() -> None:
    reader = reader_for("records", "/w", 10)
    data = _records(
        ["d", "0", "755", "1.5", "", ""],
        RECORD,
        ["c", "0", "0", "5.0", "gone", ""],
        ["l", "4", "777", "-2.500000000", "sub/link", "../a b\nc"],
        ["-", "0", "0", "9.000000000", "gone", ""],
    )
    for i in range(0, len(data), 3):
        reader.feed(data[i : i + 3])
    got = reader.manifest().entries
    assert [(p, e.kind, e.size, e.mode, e.mtime_ns, e.target) for p, e in got.items()] == [
        ("/w", "d", 0, 0o755, 1_500_000_000, None),
        ("/w/a", "f", 3, 0o644, 7_000_000_009, None),
        ("/w/sub/link", "l", 4, 0o777, -1_500_000_000, "../a b\nc"),
        ("/w/gone", "-", 0, 0, 9_000_000_000, None),  # the agent's whiteout after find's device
    ]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (_records(["x", *RECORD[1:]]), "wrong shape"),
        (_records(["f", "-3", *RECORD[2:]]), "wrong shape"),
        (_records(["f", "3", "649", *RECORD[3:]]), "wrong shape"),  # not octal
        (_records(["f", "3", "644", "7", *RECORD[4:]]), "wrong shape"),
        (_records(["f", "3", "644", "1_0.5", *RECORD[4:]]), "wrong shape"),
        (_records(["f", "3", "644", " 7.5", *RECORD[4:]]), "wrong shape"),
        (_records(["f", "9" * 30, *RECORD[2:]]), "wrong shape"),
        (_records([*RECORD[:5], "a target on a file"]), "wrong shape"),
        (_records([*RECORD[:4], "../etc", ""]), "not under"),
        (_records([*RECORD[:4], "/etc/passwd", ""]), "not under"),
        (_records([*RECORD[:4], "a//b", ""]), "not under"),
        (_records(*([*RECORD[:4], f"f{i}", ""] for i in range(3))), "over 2 entries"),
        (b"f\0" + b"x" * 20000, "over 16384 bytes"),
        (b"E\0not json\0", "not JSON"),
        (b'E\0{"hello": 1}\0', "not its end"),
        (b'E\0{"end": true, "pad": "' + b"x" * 20000 + b'"}\0', "an end over 16384 bytes"),
        (_records() + _records(RECORD), "after its end"),
    ],
    ids=lambda v: v.replace(" ", "-") if isinstance(v, str) else None,
)
def test_the_record_reader_refuses_what_is_not_a_manifest(data: bytes, says: str) -> None:
    reader = reader_for("records", "/w", 2)
    with pytest.raises(GuestError, match=says):
        reader.feed(data)
        reader.manifest()


@pytest.mark.parametrize("cut", [b"f\0003\0", b"f\0003\0644", b"E\0"])
def test_a_record_manifest_cut_short_is_refused(cut: bytes) -> None:
    reader = reader_for("records", "/w", 10)
    reader.feed(cut)
    with pytest.raises(GuestError, match="ended"):
        reader.manifest()


def test_a_manifest_format_the_daemon_does_not_know_is_refused() -> None:
    assert isinstance(reader_for(None, "/w", 1), ManifestReader)  # an agent of before
    with pytest.raises(GuestError, match="unknown format"):
        reader_for("tar", "/w", 1)


def test_the_async_sdk_diffs_as_the_sync_one(server: Server, ctl: Controller, child: str) -> None:
    from forkd.client import AsyncController, AsyncSandbox

    async def go() -> tuple[Any, Any, Any]:
        async with AsyncController(server.url, token=server.token) as actl:
            sb = await AsyncSandbox.connect(child, controller=actl)
            return (
                await sb.diff("/work"),
                await sb.diff("/work", format="patch"),
                await sb.diff("/work", format="tar"),
            )

    changes, patch, tar = asyncio.run(go())
    assert changes.of("added") == ["/work/new.txt"]
    assert patch == ctl.diff_patch(child, "/work") and tar == ctl.diff_tar(child, "/work")
    with pytest.raises(ValueError, match="json, patch or tar"):
        Sandbox(sandbox_id=child, controller=ctl).diff("/work", format="zip")  # type: ignore[call-overload]


def test_a_patch_applies_with_p1_in_the_directory_diffed(ctl: Controller, child: str) -> None:
    whole = ctl.diff_patch(child, "/")
    assert "--- a/work/edit.txt\n+++ b/work/edit.txt\n" in whole  # from / : the whole path
    one = ctl.diff_patch(child, "/work/edit.txt")  # a file: named by itself
    assert one.startswith("--- a/edit.txt\n+++ b/edit.txt\n")
