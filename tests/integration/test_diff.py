"""Diff on real VMs: what a child changed in its overlay (a file written, one of the
template's edited, one of the image's removed, a directory of the image's removed and
made again), against its snapshot and against a sibling; as a patch and a tar."""

from __future__ import annotations

import io
import tarfile

import pytest

from forkd.client import Controller

pytestmark = pytest.mark.integration

SCRIPT = (
    "set -e; echo new > /work/new.txt; echo changed > /work/setup.txt; rm /etc/hostname; "
    "mkdir -p /opt/app && echo v1 > /opt/app/conf"
)


def test_a_child_s_changes_against_its_snapshot_and_a_sibling(
    ctl: Controller, api_template: str
) -> None:
    child, sibling = (s["id"] for s in ctl.spawn_sandboxes(api_template, n=2))
    try:
        ran = ctl.exec_command(child, ["sh", "-c", SCRIPT])
        assert ran["exit_code"] == 0, ran
        res = ctl.diff_sandbox(child)
        assert res.against == api_template and not res.truncated
        got = {(c.path, c.change, c.kind) for c in res.changes}
        assert {
            ("/work/new.txt", "added", "file"),
            ("/work/setup.txt", "modified", "file"),
            ("/etc/hostname", "removed", "file"),
            ("/opt/app", "added", "dir"),
            ("/opt/app/conf", "added", "file"),
        } <= got, sorted(got)
        assert not [p for p, _, _ in got if p.startswith("/usr/")]  # nothing else walked in
        work = ctl.diff_sandbox(child, "/work")
        assert [(c.path, c.change) for c in work.changes] == [
            ("/work/new.txt", "added"),
            ("/work/setup.txt", "modified"),
        ]

        patch = ctl.diff_patch(child, "/work")
        assert "--- a/setup.txt\n+++ b/setup.txt\n" in patch
        assert "-ready\n+changed\n" in patch and "+new\n" in patch
        with tarfile.open(fileobj=io.BytesIO(ctl.diff_tar(child, "/work"))) as tar:
            names = sorted(tar.getnames())
            assert names == ["work/new.txt", "work/setup.txt"]
            assert tar.extractfile("work/setup.txt").read() == b"changed\n"  # type: ignore[union-attr]

        ctl.write_file(sibling, "/work/theirs.txt", b"sibling")
        against = ctl.diff_sandbox(child, "/work", against=sibling)
        assert against.against_kind == "sandbox"
        assert [(c.path, c.change) for c in against.changes] == [
            ("/work/new.txt", "added"),
            ("/work/setup.txt", "modified"),
            ("/work/theirs.txt", "removed"),
        ]
        etc = ctl.diff_patch(child, "/etc")  # the image's file, read through the child's view
        assert "--- a/hostname\n+++ /dev/null\n" in etc
    finally:
        for sid in (child, sibling):
            ctl.kill_sandbox(sid)
