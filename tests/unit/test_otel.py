"""``forkd serve --otlp-endpoint``: the daemon's spans and metrics reach a collector over
OTLP (a real HTTP receiver on loopback parsing them with opentelemetry-proto), the
answers name their trace, query strings leave without their values, and without the
flag nothing of OpenTelemetry is loaded. Fake VMs: the real-VM run is in
tests/integration/test_otel.py."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.metrics.export import Gauge, Sum
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import Gauge as PrometheusGauge

from forkd import tracing
from forkd.controller.app import create_app
from forkd.controller.otel.endpoint import endpoint_base
from forkd.controller.otel.prometheus_bridge import read_registry
from forkd.controller.otel.query_redaction import redact_request_span
from forkd.controller.settings import Settings
from forkd.errors import Invalid
from tests.otlp_receiver import Collector, Span, collecting
from tests.unit.conftest import TOKEN
from tests.unit.fake_images import FakeImporter
from tests.unit.fakes import FakeDriver

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def collector() -> Iterator[Collector]:
    with collecting() as c:
        yield c


@pytest.fixture
def traced(
    settings: Settings,
    driver: FakeDriver,
    importer: FakeImporter,
    collector: Collector,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[TestClient]:
    """The daemon with --otlp-endpoint at the collector (spans sent every 50 ms,
    metrics every 200 ms)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    given = dataclasses.replace(settings, otlp_endpoint=collector.url + "/")
    app = create_app(given, TOKEN, driver=driver, importer=importer)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c
    assert not tracing.enabled()  # the daemon's stop took its tracer away


def _trace_of(answer_header: str) -> str:
    version, trace_id, span_id, flags = answer_header.split("-")
    assert (version, len(trace_id), len(span_id)) == ("00", 32, 16)
    assert int(flags, 16) & 1  # sampled
    return trace_id


def _in_trace(collector: Collector, trace_id: str) -> dict[str, Span]:
    return {s.name: s for s in collector.spans if s.trace_id == trace_id}


def test_a_fork_and_a_branch_reach_the_collector_as_one_trace_each(
    traced: TestClient, collector: Collector
) -> None:
    assert traced.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).status_code == 201
    forked = traced.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 2})
    assert forked.status_code == 201, forked.text
    fork_trace = _trace_of(forked.headers["traceresponse"])
    sid = forked.json()[0]["id"]
    branched = traced.post(f"/v1/sandboxes/{sid}/branch", json={"tag": "b1"})
    assert branched.status_code == 201, branched.text
    branch_trace = _trace_of(branched.headers["traceresponse"])
    assert fork_trace != branch_trace

    branch_request = "POST /v1/sandboxes/{sandbox_id}/branch"
    collector.until(lambda c: branch_request in _in_trace(c, branch_trace))
    collector.until(lambda c: "POST /v1/sandboxes" in _in_trace(c, fork_trace))
    spans = _in_trace(collector, fork_trace)
    request = spans["POST /v1/sandboxes"]
    assert request.parent_id == "" and request.service == "forkd"
    assert spans["forkd.fork"].parent_id == request.span_id
    assert spans["forkd.fork"].attributes == {"forkd.snapshot_tag": "py", "forkd.count": 2}
    restores = [
        s for s in collector.spans if s.trace_id == fork_trace and s.name == "forkd.restore"
    ]
    assert {s.parent_id for s in restores} == {spans["forkd.fork"].span_id}
    assert {s.attributes["forkd.sandbox_id"] for s in restores} == {
        info["id"] for info in forked.json()
    }

    spans = _in_trace(collector, branch_trace)
    branch = spans["forkd.branch"]
    assert branch.parent_id == spans[branch_request].span_id
    assert branch.attributes == {"forkd.sandbox_id": sid, "forkd.tag": "b1"}
    assert spans["forkd.snapshot.pause"].parent_id == branch.span_id
    assert spans["forkd.snapshot.capture"].parent_id == spans["forkd.snapshot.pause"].span_id
    assert spans["forkd.snapshot.write"].parent_id == branch.span_id


def test_the_daemons_metrics_go_out_with_its_latencies_as_histograms(
    traced: TestClient, collector: Collector
) -> None:
    traced.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128})
    assert traced.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 1}).status_code == 201
    collector.until(lambda c: "forkd_fork_seconds" in c.metric_names())
    by_name = {p.metric: p for p in collector.points}
    assert by_name["forkd_fork_seconds"].kind == "histogram"
    assert by_name["forkd_fork_seconds"].value == 1  # one fork observed
    assert by_name["forkd_snapshots_total"].kind == "gauge"
    assert by_name["forkd_snapshots_total"].value == 1
    assert by_name["forkd_build_info"].attributes["version"]
    # no series per sandbox: reading them would keep asking every guest for its figures
    assert not [name for name in by_name if name.startswith("forkd_sandbox_")]
    assert "forkd_sandbox_cpu_seconds" in traced.get("/metrics").text  # still scraped
    assert "http.server.duration" in by_name or "http.server.request.duration" in by_name


def test_a_refused_fork_has_its_request_span_alone_and_scrapes_are_not_traced(
    traced: TestClient, collector: Collector
) -> None:
    missing = traced.post("/v1/sandboxes", json={"snapshot_tag": "nope", "n": 1})
    assert missing.status_code == 404
    assert traced.get("/metrics").status_code == 200
    assert "traceresponse" not in traced.get("/metrics").headers
    trace_id = _trace_of(missing.headers["traceresponse"])
    collector.until(
        lambda c: "forkd.fork" not in _in_trace(c, trace_id) and bool(_in_trace(c, trace_id))
    )
    assert not [s for s in collector.spans if "metrics" in s.name]


def test_a_collector_that_hangs_delays_no_answer_and_the_stop_only_boundedly(
    settings: Settings, driver: FakeDriver, collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every export waits 60 s for an answer: the API answers as ever, spans past the
    exporter's queue are dropped, and the daemon's stop gives up on the last export
    after its timeouts instead of waiting for the collector."""
    collector.hang_secs = 60
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    given = dataclasses.replace(settings, otlp_endpoint=collector.url)
    app = create_app(given, TOKEN, driver=driver)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        assert c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).status_code == 201
        collector.until(lambda col: bool(col.requests))  # an export is hanging now
        for _ in range(5):
            assert c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 1}).status_code == 201
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 30  # not the collector's 60 s per export
    assert not tracing.enabled()


def test_a_callers_traceparent_is_joined(traced: TestClient, collector: Collector) -> None:
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    got = traced.get(
        "/v1/snapshots", headers={"traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01"}
    )
    assert _trace_of(got.headers["traceresponse"]) == caller_trace
    collector.until(lambda c: bool(_in_trace(c, caller_trace)))
    (request,) = _in_trace(collector, caller_trace).values()
    assert request.parent_id == "00f067aa0ba902b7"


def test_query_strings_leave_without_their_values(traced: TestClient, collector: Collector) -> None:
    traced.get("/v1/sandboxes?label=secret-value&x=a%26token%3Dhidden")
    collector.until(lambda c: any(s.name == "GET /v1/sandboxes" for s in c.spans))
    (span,) = collector.named("GET /v1/sandboxes")
    exported = json.dumps(span.attributes)
    assert "secret-value" not in exported and "hidden" not in exported
    assert "token" not in exported
    assert any("REDACTED" in str(v) for v in span.attributes.values())


def test_query_redaction_rewrites_every_url_attribute() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    given = {
        "url.query": "signature=abc",
        "http.target": "/e2b-build-files/b/h?signature=abc",
        "http.url": "http://h/p?token=t&x=1",
        "url.full": "http://h/p",
        "url.path": "/p",
    }
    with provider.get_tracer("t").start_as_current_span("s", attributes=given) as live:
        redact_request_span(live, {})
    (ended,) = exporter.get_finished_spans()
    assert dict(ended.attributes or {}) == {
        "url.query": "REDACTED",
        "http.target": "/e2b-build-files/b/h?REDACTED",
        "http.url": "http://h/p?REDACTED",
        "url.full": "http://h/p",
        "url.path": "/p",
    }


def test_the_registrys_counters_and_gauges_become_otlp_metrics() -> None:
    registry = CollectorRegistry()
    Counter("forkd_wakes", "wakes", ["from"], registry=registry).labels("paused").inc(3)
    PrometheusGauge("forkd_sandboxes_active", "running", registry=registry).set(2)
    Histogram("forkd_fork_seconds", "forks", registry=registry).observe(0.1)
    read = {m.name: m for m in read_registry(registry, 1, 2)}
    assert set(read) == {"forkd_wakes", "forkd_sandboxes_active"}  # histograms: their own
    wakes = read["forkd_wakes"].data
    assert isinstance(wakes, Sum) and wakes.is_monotonic
    (point,) = wakes.data_points
    assert (point.value, dict(point.attributes or {})) == (3.0, {"from": "paused"})
    running = read["forkd_sandboxes_active"].data
    assert isinstance(running, Gauge) and running.data_points[0].value == 2.0


@pytest.mark.parametrize(
    "url",
    [
        "collector:4318",
        "ftp://collector",
        "http://",
        "http://user:pw@collector:4318",
        "http://collector:4318/?x=1",
        "http://collector:99999",
    ],
)
def test_a_bad_endpoint_is_refused_before_the_daemon_starts(url: str) -> None:
    with pytest.raises(Invalid, match="--otlp-endpoint"):
        endpoint_base(url)


def test_an_endpoint_keeps_its_path_without_a_trailing_slash() -> None:
    assert endpoint_base("https://otel.example.com/ingest/") == "https://otel.example.com/ingest"


def test_without_the_flag_nothing_of_opentelemetry_is_loaded(tmp_path: Path) -> None:
    """The daemon's app, made and asked a request in a fresh interpreter: nothing of
    OpenTelemetry's SDK, exporters or instrumentation is imported (FastAPI itself may
    import OpenTelemetry's API when it is installed), and answers name no trace."""
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from fastapi.testclient import TestClient
        from forkd.controller.app import create_app
        from forkd.controller.settings import Settings
        state = Path({str(tmp_path)!r})
        s = Settings(state_dir=state, snapshot_root=state / "snap", run_dir=state / "run",
                     pool_size=0, cgroup_root=state / "no-cgroups")
        from tests.unit.fakes import FakeDriver
        with TestClient(create_app(s, None, driver=FakeDriver())) as c:
            r = c.get("/v1/snapshots")
            assert r.status_code == 200, r.text
            assert "traceresponse" not in r.headers
        ours = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation",
                "forkd.controller.otel")
        loaded = sorted(m for m in sys.modules if m.startswith(ours))
        print(",".join(loaded))
        """
    )
    root = SRC.parent
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env={"PYTHONPATH": f"{SRC}:{root}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
