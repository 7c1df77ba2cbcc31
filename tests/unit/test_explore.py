"""Explore over the HTTP API, on the fake driver: one branch, a child per variant, each
run and scored, the best kept, the rest killed, the source untouched; and nothing left
behind when the request is bad, a variant fails, the fork fails or the client leaves."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from forkd import limits
from forkd.client import Controller, ControllerError
from forkd.controller.services.explore_scores import (
    Outcome,
    StepFailed,
    chosen,
    parse_score,
    ranked,
)
from tests.unit.conftest import Server


@pytest.fixture
def ctl(server: Server) -> Iterator[Controller]:
    with Controller(server.url, token=server.token) as c:
        c.create_snapshot("py", memory_mib=128)
        yield c


@pytest.fixture
def source(ctl: Controller) -> str:
    return str(ctl.spawn_sandboxes("py", metadata={"team": "a"})[0]["id"])


def _others(ctl: Controller, source: str) -> list[dict[str, Any]]:
    return [s for s in ctl.list_sandboxes() if s["id"] != source]


def _snapshots(ctl: Controller) -> list[str]:
    return sorted(s["tag"] for s in ctl.list_snapshots())


def test_scores_rank_the_variants_and_only_the_best_run_on(ctl: Controller, source: str) -> None:
    variants = [{"eval": f"x = {v}"} for v in (3, 9, 1, 7)]
    res = ctl.explore_sandbox(source, variants, score={"eval": "x * 2"}, keep=2, seed=10)
    assert [r.index for r in res.results] == [1, 3, 0, 2]
    assert [r.score for r in res.results] == [18.0, 14.0, 6.0, 2.0]
    assert [r.kept for r in res.results] == [True, True, False, False]
    assert res.best is not None and res.best.index == 1
    assert res.pause_ms is not None and res.branch_kept
    alive = {s["id"]: s for s in _others(ctl, source)}
    assert set(alive) == {r.sandbox_id for r in res.kept}  # the losers are gone
    best = alive[res.results[0].sandbox_id]
    assert best["snapshot_tag"] == res.branch and best["seed"] == 11
    assert best["metadata"] == {
        "team": "a",
        "forkd.explore": res.branch,
        "forkd.parent": source,
        "forkd.variant": "1",
        "forkd.score": "18",
    }
    assert ctl.get_sandbox(source)["state"] == "running"
    assert ctl.snapshot(res.branch)["metadata"]["forkd.explore"] == res.branch
    assert ctl.eval_code(best["id"], "x")["result"] == "9"  # it is the variant's state


def test_minimize_puts_the_lowest_first(ctl: Controller, source: str) -> None:
    variants = [["echo", n] for n in ("5", "2", "8")]
    res = ctl.explore_sandbox(source, variants, score=["echo", "ignored"], keep=0)
    assert {r.score for r in res.results} == {None}  # "ignored" is no number
    res = ctl.explore_sandbox(
        source,
        [{"eval": f"y = {v}"} for v in (5, 2, 8)],
        score={"eval": "y"},
        minimize=True,
        keep=1,
    )
    assert [r.score for r in res.results] == [2.0, 5.0, 8.0]


def test_a_failing_variant_has_its_error_and_the_others_go_on(ctl: Controller, source: str) -> None:
    variants: list[Any] = [
        ["exit", "3"],  # the step fails
        {"eval": "raise ValueError('no plan')"},  # so does this one
        {"eval": "z = 'text'"},  # its score is no number
        {"eval": "z = 4"},
    ]
    res = ctl.explore_sandbox(source, variants, score={"eval": "z"}, keep=4)
    by_index = {r.index: r for r in res.results}
    assert res.results[0].index == 3 and res.results[0].score == 4.0
    assert by_index[0].score is None and by_index[0].exit_code == 3
    assert "step exited 3" in (by_index[0].error or "")
    assert "ValueError: no plan" in (by_index[1].error or "")
    assert "no number" in (by_index[2].error or "") and by_index[2].score_tail == "'text'"
    assert res.results[0].score_tail == "4"  # what the score returned, kept
    assert [r.kept for r in res.results] == [True, False, False, False]  # only scored ones
    assert len(_others(ctl, source)) == 1


def test_without_a_score_the_first_that_succeed_are_kept(ctl: Controller, source: str) -> None:
    res = ctl.explore_sandbox(source, [["exit", "1"], "echo ok", "echo fine"], keep=1)
    assert [r.index for r in res.results] == [0, 1, 2]  # variant order
    assert [r.kept for r in res.results] == [False, True, False]
    assert res.results[1].stdout_tail == "-c echo ok\n"  # the fake echoes its argv


def test_keep_as_snapshots_branches_the_best_and_kills_every_child(
    ctl: Controller, source: str
) -> None:
    before = _snapshots(ctl)
    variants = [{"eval": f"w = {v}"} for v in (1, 2)]
    res = ctl.explore_sandbox(
        source, variants, score={"eval": "w"}, keep=1, keep_as="snapshots", tag="try"
    )
    assert res.branch == "try" and not res.branch_kept
    assert res.results[0].snapshot_tag == "try-v1" and res.results[0].kept
    assert _others(ctl, source) == []
    assert _snapshots(ctl) == sorted([*before, "try-v1"])  # the branch itself is gone
    labels = ctl.snapshot("try-v1")["metadata"]
    assert labels["forkd.score"] == "2" and labels["forkd.variant"] == "1"
    child = ctl.spawn_sandboxes("try-v1")[0]
    assert ctl.eval_code(child["id"], "w")["result"] == "2"


def test_keep_zero_leaves_nothing_but_the_answer(ctl: Controller, source: str) -> None:
    before = _snapshots(ctl)
    res = ctl.explore_sandbox(source, ["true", "true"], keep=0)
    assert [r.error for r in res.results] == [None, None]
    assert _others(ctl, source) == [] and _snapshots(ctl) == before


def test_events_report_each_variant_and_the_end(ctl: Controller, source: str) -> None:
    res = ctl.explore_sandbox(
        source, [{"eval": f"v = {i}"} for i in range(3)], score={"eval": "v"}, keep=1
    )
    seen = []
    for event in ctl.events(["explore_variant", "explored"], source, since=0):
        seen.append(event)
        if event["type"] == "explored":
            break
    variants = [e for e in seen if e["type"] == "explore_variant"]
    assert sorted(e["index"] for e in variants) == [0, 1, 2]
    assert {e["explore"] for e in seen} == {res.branch}
    assert {e["score"] for e in variants} == {0.0, 1.0, 2.0}
    assert seen[-1]["kept"] == [res.results[0].sandbox_id] and seen[-1]["best"] == 2.0


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"variants": []}, "variants"),
        ({"variants": [{}]}, "exactly one of exec"),
        ({"variants": [{"exec": ["a"], "eval": "b"}]}, "exactly one of exec"),
        ({"variants": [{"eval": "1", "env": {"A": "b"}}]}, "env go with exec"),
        ({"variants": [{"exec": ["true"]}] * (limits.MAX_EXPLORE_VARIANTS + 1)}, "variants"),
        ({"variants": [{"exec": ["true"]}], "keep": 2}, "keep 2 is more than"),
        ({"variants": [{"exec": ["true"]}], "bogus": 1}, "unknown field"),
        ({"variants": [{"exec": ["true"]}], "keep_as": "files"}, "keep_as"),
        ({"variants": [{"exec": ["true"]}] * 2, "seed": limits.MAX_SEED}, "seed"),
        ({"variants": [{"exec": ["true"]}], "tag": "no/slash"}, "tag"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v else None,
)
def test_bad_input_is_a_400_and_makes_nothing(
    ctl: Controller, server: Server, source: str, body: dict[str, Any], says: str
) -> None:
    before = _snapshots(ctl)
    resp = httpx.post(
        f"{server.url}/v1/sandboxes/{source}/explore",
        json=body,
        headers={"Authorization": f"Bearer {server.token}"},
    )
    assert resp.status_code == 400, resp.text
    assert says in resp.json()["error"]
    assert _others(ctl, source) == [] and _snapshots(ctl) == before


def test_an_unknown_source_is_a_404(ctl: Controller) -> None:
    with pytest.raises(ControllerError) as exc:
        ctl.explore_sandbox("sb-nope", ["true"])
    assert exc.value.status == 404


def test_a_fork_that_fails_takes_the_branch_back(
    ctl: Controller, server: Server, source: str
) -> None:
    before = _snapshots(ctl)
    server.driver.fail_restore = RuntimeError("qemu would not start")
    with pytest.raises(ControllerError) as exc:
        ctl.explore_sandbox(source, ["true", "true"])
    assert exc.value.status == 500
    assert _others(ctl, source) == [] and _snapshots(ctl) == before
    assert ctl.get_sandbox(source)["state"] == "running"


def test_the_timeout_fails_the_slow_variants_only(ctl: Controller, source: str) -> None:
    res = ctl.explore_sandbox(
        source, [["nap", "30"], ["echo", "1"]], score=["echo", "2"], timeout_secs=1.0, keep=2
    )
    by_index = {r.index: r for r in res.results}
    assert by_index[1].score == 2.0 and by_index[1].kept
    assert by_index[0].score is None and "timed out" in (by_index[0].error or "")
    assert [s["id"] for s in _others(ctl, source)] == [by_index[1].sandbox_id]


def test_a_client_that_leaves_cancels_it_and_nothing_is_left(
    ctl: Controller, server: Server, source: str
) -> None:
    before = _snapshots(ctl)
    body = json.dumps({"variants": [{"exec": ["nap", "30"]}] * 3}).encode()

    def leave_early() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.url}/v1/sandboxes/{source}/explore",
                content=body,
                headers={"Authorization": f"Bearer {server.token}"},
                timeout=httpx.Timeout(5.0, read=1.5),
            )

    client = threading.Thread(target=leave_early)
    client.start()
    deadline = time.monotonic() + 10
    while len(_others(ctl, source)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the children are up and napping
    assert len(_others(ctl, source)) == 3
    client.join()
    deadline = time.monotonic() + 10
    while (_others(ctl, source) or _snapshots(ctl) != before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _others(ctl, source) == [] and _snapshots(ctl) == before
    assert ctl.get_sandbox(source)["state"] == "running"


def test_parse_score_takes_the_last_line_as_a_number() -> None:
    assert parse_score("running\n3 passed\n42\n\n", "score") == 42.0
    assert parse_score("np.float64(0.25)", "score") == 0.25
    assert parse_score(" -1e3 ", "score") == -1000.0
    for bad, says in (("", "printed nothing"), ("3 passed", "no number"), ("nan", "finite")):
        with pytest.raises(StepFailed, match=says):
            parse_score(bad, "score")


def test_ranking_puts_unscored_last_and_ties_in_variant_order() -> None:
    outs = [
        Outcome(0, "a", score=None, error="x"),
        Outcome(1, "b", score=2.0),
        Outcome(2, "c", score=5.0),
        Outcome(3, "d", score=2.0),
    ]
    assert [o.index for o in ranked(outs, minimize=False)] == [2, 1, 3, 0]
    assert [o.index for o in ranked(outs, minimize=True)] == [1, 3, 2, 0]
    assert [o.index for o in chosen(ranked(outs, False), 9, scored=True)] == [2, 1, 3]


# ------------------------------------------------------------ found in review


def test_a_score_line_made_to_be_slow_to_parse_is_no_number() -> None:
    with pytest.raises(StepFailed, match="no number"):
        parse_score("a(" + " " * 100_000 + "x", "score")  # once cubic: minutes
    with pytest.raises(StepFailed, match="no number"):
        parse_score("a(" + " " * 120 + "x", "score")
    with pytest.raises(StepFailed, match="200 characters"):
        parse_score("1" * 200, "score")
    assert parse_score("x" * 1_000_000 + "\nf(  2.5 )", "score") == 2.5  # the end only


def test_a_branch_that_fails_after_registering_leaves_no_snapshot(
    ctl: Controller, server: Server, source: str
) -> None:
    before = _snapshots(ctl)
    vm = next(v for v in server.driver.vms if v.id == source)
    vm.fail = "resume"  # the snapshot is written and registered, then resuming fails
    with pytest.raises(ControllerError) as exc:
        ctl.explore_sandbox(source, ["true"], tag="half")
    assert exc.value.status == 500
    assert _snapshots(ctl) == before and _others(ctl, source) == []


def test_exploring_from_a_variant_does_not_pass_its_marks_on(ctl: Controller, source: str) -> None:
    first = ctl.explore_sandbox(source, [{"eval": "v = 7"}], score={"eval": "v"}, keep=1)
    kept = str(first.results[0].sandbox_id)
    assert ctl.get_sandbox(kept)["metadata"]["forkd.score"] == "7"
    second = ctl.explore_sandbox(kept, [["exit", "1"], ["true"]], keep=1, tag="deeper")
    labels = ctl.snapshot("deeper")["metadata"]
    assert "forkd.score" not in labels and "forkd.variant" not in labels
    assert labels["forkd.parent"] == kept and labels["forkd.explore"] == "deeper"
    child = ctl.get_sandbox(str(second.results[1].sandbox_id))
    assert child["metadata"]["forkd.variant"] == "1" and "forkd.score" not in child["metadata"]


def test_checks_that_need_no_vm_come_before_the_branch(
    ctl: Controller, server: Server, source: str
) -> None:
    before = _snapshots(ctl)
    vm = next(v for v in server.driver.vms if v.id == source)
    crowded = {f"k{i}": "v" for i in range(61)}  # with the explore's 4 marks: over 64
    crowded_source = str(ctl.spawn_sandboxes("py", metadata=crowded)[0]["id"])
    ctl.branch_sandbox(source, tag="taken-v1")
    for sid, kwargs, status in (
        (crowded_source, {}, 400),  # the labels would pass the cap
        (source, {"metadata": {"forkd.score": "99"}}, 400),  # the explore's own keys
        (source, {"tag": "taken-v1"}, 409),  # the tag exists
        (source, {"tag": "taken", "keep_as": "snapshots"}, 409),  # a kept name exists
    ):
        with pytest.raises(ControllerError) as exc:
            ctl.explore_sandbox(sid, ["true", "true"], **kwargs)
        assert exc.value.status == status, (kwargs, exc.value)
    assert "pause" not in vm.events[vm.events.index("pause") + 1 :]  # one pause: the branch
    assert _snapshots(ctl) == sorted([*before, "taken-v1"])


def test_a_client_that_leaves_while_the_losers_die_leaves_nothing(
    ctl: Controller, server: Server, source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.unit.fakes import FakeVM

    before = _snapshots(ctl)
    slow_kill = FakeVM.kill

    async def kill(self: FakeVM) -> None:
        await asyncio.sleep(1.0)
        await slow_kill(self)

    monkeypatch.setattr(FakeVM, "kill", kill)
    body = json.dumps({"variants": [{"exec": ["true"]}] * 3, "keep": 1}).encode()
    with pytest.raises(httpx.ReadTimeout):  # gone while the two losers are being killed
        httpx.post(
            f"{server.url}/v1/sandboxes/{source}/explore",
            content=body,
            headers={"Authorization": f"Bearer {server.token}"},
            timeout=httpx.Timeout(5.0, read=0.5),
        )
    deadline = time.monotonic() + 15
    while (_others(ctl, source) or _snapshots(ctl) != before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _others(ctl, source) == [] and _snapshots(ctl) == before  # the kept one too


def test_a_variant_can_have_its_own_network_policy(ctl: Controller, source: str) -> None:
    variants: list[dict[str, Any]] = [
        {"eval": "x = 1"},
        {"eval": "x = 2", "network": {"deny_out": ["*"]}},
    ]
    res = ctl.explore_sandbox(source, variants, score={"eval": "x"}, keep=2)
    policies = {r.index: ctl.sandbox_network(str(r.sandbox_id)) for r in res.results}
    assert policies[1]["deny_out"] == ["*"]  # its own, set before it ran
    assert policies[0]["deny_out"] == []  # the source's, from the branch
    with pytest.raises(ControllerError) as bad:
        ctl.explore_sandbox(source, variants, score={"eval": "x", "network": {}})
    assert bad.value.status == 400 and "network goes with a variant" in bad.value.message
