"""An OpenTelemetry collector for the tests: a real HTTP server on loopback, in a thread,
that takes OTLP/HTTP exports (protobuf, gzip or not) and keeps the spans and metrics it
parses with the ``opentelemetry-proto`` package, as a collector would."""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.http_thread import in_thread


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # hex, as a traceresponse header carries it
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, Any]
    service: str  # the resource's service.name
    error: bool  # status code ERROR


@dataclass(frozen=True)
class Point:
    metric: str
    kind: str  # "sum", "gauge", "histogram"
    attributes: dict[str, Any]
    value: float  # a sum's or gauge's value; a histogram's count


@dataclass
class Collector:
    port: int
    spans: list[Span] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # each export's path
    hang_secs: float = 0.0  # a collector that takes this long to answer each export

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def until(self, check: Callable[[Collector], bool], secs: float = 20.0) -> None:
        deadline = time.monotonic() + secs
        while not check(self):
            if time.monotonic() > deadline:
                names = sorted({s.name for s in self.spans})
                raise AssertionError(
                    f"the collector has spans {names} and {len(self.points)} points"
                )
            time.sleep(0.05)

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]

    def metric_names(self) -> set[str]:
        return {p.metric for p in self.points}

    def take_traces(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            service = _attributes(resource.resource.attributes).get("service.name", "")
            for scope in resource.scope_spans:
                for s in scope.spans:
                    self.spans.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes=_attributes(s.attributes),
                            service=service,
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )

    def take_metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    self.points.extend(_points(metric))


def _attributes(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kv in pairs:
        kind = kv.value.WhichOneof("value")
        found[kv.key] = getattr(kv.value, kind) if kind else None
    return found


def _points(metric: Any) -> list[Point]:
    kind = metric.WhichOneof("data")
    if kind in ("sum", "gauge"):
        return [
            Point(
                metric.name,
                kind,
                _attributes(p.attributes),
                p.as_int if p.WhichOneof("value") == "as_int" else p.as_double,
            )
            for p in getattr(metric, kind).data_points
        ]
    if kind == "histogram":
        return [
            Point(metric.name, kind, _attributes(p.attributes), p.count)
            for p in metric.histogram.data_points
        ]
    return []


def _handler(collector: Collector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            collector.requests.append(self.path)
            if collector.hang_secs:
                time.sleep(collector.hang_secs)
            if self.path == "/v1/traces":
                collector.take_traces(body)
                answer = ExportTraceServiceResponse().SerializeToString()
            elif self.path == "/v1/metrics":
                collector.take_metrics(body)
                answer = ExportMetricsServiceResponse().SerializeToString()
            else:
                self.send_response(404)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_args: Any) -> None:
            pass

    return Handler


@contextmanager
def collecting() -> Iterator[Collector]:
    """A collector listening on a free loopback port until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    found = Collector(int(server.server_address[1]))
    server.RequestHandlerClass = _handler(found)  # it needs the port the server took
    with in_thread(server):
        yield found
