"""``forkd serve --otlp-endpoint URL``: the daemon's traces and metrics, sent over OTLP.

Traces: a server span for every API request (E2B's too), made by OpenTelemetry's
FastAPI instrumentation, and under it a span for each step the daemon's code marks
(:mod:`forkd.tracing`: a fork, each child's restore, a branch's pause, capture and
write, an image import, a wake). Each answer carries a W3C ``traceresponse`` header
naming its trace, and a request that comes with a ``traceparent`` joins the caller's
trace. Metrics: the instrumentation's HTTP server metrics, every latency as an
OpenTelemetry histogram, and the counters and gauges of ``/metrics``
(:mod:`.prometheus_bridge`).

Both go to ``<URL>/v1/traces`` and ``<URL>/v1/metrics`` over OTLP/HTTP (protobuf), as
OpenTelemetry's ``OTEL_EXPORTER_OTLP_ENDPOINT`` is read. The exporters run in threads
of their own with bounded queues and timeouts, so a slow or dead collector costs the
API nothing: spans past the queue are dropped. The SDK's own environment variables
apply (``OTEL_EXPORTER_OTLP_HEADERS`` for a collector's credentials,
``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_BSP_SCHEDULE_DELAY``).

This module is imported only when the flag is given: without it nothing of the
OpenTelemetry SDK is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading

from fastapi import FastAPI
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.instrumentation.propagators import (
    TraceResponsePropagator,
    set_global_response_propagator,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from forkd import __version__, tracing
from forkd.controller.metrics import Metrics
from forkd.controller.otel.endpoint import endpoint_base
from forkd.controller.otel.prometheus_bridge import RegistryExporter
from forkd.controller.otel.query_redaction import redact_request_span

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 5.0  # one export's HTTP request, retries included
SHUTDOWN_S = 10.0  # what the daemon's stop waits for the last spans and metrics
EXCLUDED_URLS = "/metrics$"  # scrapes are not traced (a Prometheus's every 15 s)


class Telemetry:
    """The tracer and meter providers of one daemon and their OTLP exporters."""

    def __init__(self, endpoint: str) -> None:
        base = endpoint_base(endpoint)
        resource = Resource.create(
            {
                "service.name": "forkd",
                "service.version": __version__,
                "host.name": socket.gethostname(),
            }
        )
        self.tracer_provider = TracerProvider(resource=resource)
        spans = OTLPSpanExporter(endpoint=f"{base}/v1/traces", timeout=EXPORT_TIMEOUT_S)
        self.tracer_provider.add_span_processor(BatchSpanProcessor(spans))
        self.metric_exporter = RegistryExporter(
            OTLPMetricExporter(endpoint=f"{base}/v1/metrics", timeout=EXPORT_TIMEOUT_S),
            resource,
        )
        reader = PeriodicExportingMetricReader(self.metric_exporter)
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        set_global_response_propagator(TraceResponsePropagator())  # type: ignore[no-untyped-call]
        self.endpoint = base

    def instrument(self, app: FastAPI) -> None:
        """A server span for each of ``app``'s requests (the daemon's, E2B's)."""
        FastAPIInstrumentor.instrument_app(
            app,
            tracer_provider=self.tracer_provider,
            meter_provider=self.meter_provider,
            excluded_urls=EXCLUDED_URLS,
            server_request_hook=redact_request_span,
            # no span per chunk of a body: a stream's would be thousands
            exclude_spans=["receive", "send"],
        )

    def start(self, metrics: Metrics) -> None:
        """(On the daemon's loop.) The daemon's services exist: their steps make spans
        from now on, and ``metrics`` go out with every export."""
        self.metric_exporter.read_from(metrics.registry, asyncio.get_running_loop())
        metrics.export_latencies(self.meter_provider.get_meter("forkd", __version__))
        tracing.install(self.tracer_provider.get_tracer("forkd", __version__))
        log.info("traces and metrics go to the OpenTelemetry collector at %s", self.endpoint)

    async def stop(self) -> None:
        """Send what is left and stop, waiting at most :data:`SHUTDOWN_S` for a slow
        collector: what it has not taken by then is dropped. Called on the daemon's
        loop before its state closes, since the last export still reads it."""
        tracing.uninstall()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def shut_down() -> None:
            try:
                self.tracer_provider.shutdown()
                self.meter_provider.shutdown(timeout_millis=SHUTDOWN_S * 1000)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    loop.call_soon_threadsafe(_settle, done)

        # A thread of its own, not the loop's executor: one still stuck in an export when
        # the daemon exits must not hold the interpreter's exit up.
        threading.Thread(target=shut_down, name="forkd-otel-stop", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), SHUTDOWN_S)
        except TimeoutError:
            log.warning(
                "the OpenTelemetry collector at %s took over %g s: what it was not sent is dropped",
                self.endpoint,
                SHUTDOWN_S,
            )
        self.metric_exporter.stop_reading()


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)
