"""``forkd explore`` and ``forkd diff`` against the real app (fake VMs): the ranking it
prints, its JSON, its refusals, the scores it leaves on the lineage tree; the changes."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from forkd.client import Controller
from tests.unit.conftest import Invoke

VARIANTS = ["-v", "x = 3", "-v", "x = 9", "-v", "raise SystemError('no')"]


def test_explore_prints_the_ranking_and_keeps_the_best(
    forkd: Invoke,
    ctl: Controller,
    sid: str,
) -> None:
    res = forkd("explore", sid, "--eval", *VARIANTS, "--score-eval", "x * 10", "--keep", "1")
    assert res.exit_code == 0, res.output
    rows = [r for r in map(str.split, res.stdout.splitlines()) if r and r[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "0", "2"]  # best first, the failed one last
    assert "90" in rows[0] and rows[0][-1] == "yes"
    assert "SystemError" in res.stdout
    kept = [s for s in ctl.list_sandboxes() if s["id"] != sid]
    assert [s["metadata"]["forkd.score"] for s in kept] == ["90"]
    tree = forkd("tree")
    assert "variant 1" in tree.stdout and "score 90" in tree.stdout, tree.stdout


def test_explore_json_is_the_answer(forkd: Invoke, sid: str) -> None:
    res = forkd(
        "explore", sid, "--json", "--eval", "-v", "1", "-v", "1/0", "--keep", "0", "--tag", "mine"
    )
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert body["branch"] == "mine" and not body["branch_kept"]
    assert [r["index"] for r in body["results"]] == [0, 1]
    assert "ZeroDivisionError" in body["results"][1]["error"]


def test_score_and_score_eval_exclude_each_other(forkd: Invoke, sid: str) -> None:
    res = forkd("explore", sid, "-v", "true", "--score", "echo 1", "--score-eval", "1")
    assert res.exit_code == 2 and "not both" in res.output


def test_diff_prints_the_changes_a_patch_and_a_tar(
    forkd: Invoke,
    ctl: Controller,
    sid: str,
    tmp_path: Path,
) -> None:
    ctl.write_file(sid, "/work/a.txt", "one\n")
    res = forkd("diff", sid, "--path", "/work")
    assert res.exit_code == 0, res.output
    assert "/work/a.txt" in res.stdout and "+" in res.stdout
    assert "1 added, 0 modified, 0 removed" in res.stderr
    res = forkd("diff", sid, "--path", "/work", "--patch")
    assert "+++ b/a.txt" in res.stdout and "+one" in res.stdout
    out = tmp_path / "changes.tar"
    assert forkd("diff", sid, "--path", "/work", "--tar", str(out)).exit_code == 0
    with tarfile.open(out) as tar:
        assert tar.getnames() == ["work/a.txt"]
    body = json.loads(forkd("diff", sid, "--json", "--path", "/work").stdout)
    assert [c["change"] for c in body["changes"]] == ["added"]
