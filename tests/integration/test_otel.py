"""Real VMs, traced: the suite's daemon runs with ``--otlp-endpoint`` at a collector on
loopback (conftest's ``otlp``), and a fork and a branch of real guests reach it as
traces whose ids their answers name, with the steps the daemon took under them."""

from __future__ import annotations

import httpx

from tests.integration.conftest import Daemon
from tests.otlp_receiver import Collector, Span


def _trace_id(answer: httpx.Response) -> str:
    return answer.headers["traceresponse"].split("-")[1]


def _spans(otlp: Collector, trace_id: str) -> dict[str, list[Span]]:
    found: dict[str, list[Span]] = {}
    for span in list(otlp.spans):
        if span.trace_id == trace_id:
            found.setdefault(span.name, []).append(span)
    return found


def test_a_fork_and_a_branch_of_real_guests_are_traced(
    daemon: Daemon, api_template: str, otlp: Collector
) -> None:
    auth = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=auth, timeout=120) as http:
        forked = http.post("/v1/sandboxes", json={"snapshot_tag": api_template, "n": 2})
        assert forked.status_code == 201, forked.text
        ids = [info["id"] for info in forked.json()]
        branched = http.post(f"/v1/sandboxes/{ids[0]}/branch", json={"tag": "otel-branch"})
        assert branched.status_code == 201, branched.text
        try:
            fork_trace, branch_trace = _trace_id(forked), _trace_id(branched)
            otlp.until(lambda c: "forkd.snapshot.write" in _spans(c, branch_trace))
            otlp.until(lambda c: len(_spans(c, fork_trace).get("forkd.restore", [])) == 2)

            spans = _spans(otlp, fork_trace)
            (request,) = spans["POST /v1/sandboxes"]
            (fork,) = spans["forkd.fork"]
            assert fork.parent_id == request.span_id
            assert fork.attributes["forkd.snapshot_tag"] == api_template
            restores = spans["forkd.restore"]
            assert {s.parent_id for s in restores} == {fork.span_id}
            assert {s.attributes["forkd.sandbox_id"] for s in restores} == set(ids)

            spans = _spans(otlp, branch_trace)
            (branch,) = spans["forkd.branch"]
            assert branch.parent_id == spans["POST /v1/sandboxes/{sandbox_id}/branch"][0].span_id
            (pause,) = spans["forkd.snapshot.pause"]
            assert pause.parent_id == branch.span_id
            assert spans["forkd.snapshot.capture"][0].parent_id == pause.span_id
            assert spans["forkd.snapshot.write"][0].parent_id == branch.span_id
            assert not any(s.error for s in otlp.spans if s.trace_id in (fork_trace, branch_trace))

            # and the daemon's metrics with them: this fork in its latency histogram
            otlp.until(lambda c: "forkd_fork_seconds" in c.metric_names())
        finally:
            for sid in ids:
                http.delete(f"/v1/sandboxes/{sid}")
            http.delete("/v1/snapshots/otel-branch")
