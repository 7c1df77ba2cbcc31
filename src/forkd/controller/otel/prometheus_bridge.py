"""The daemon's Prometheus counters and gauges, sent along with its OpenTelemetry metrics.

forkd keeps its metrics in a ``prometheus_client`` registry, scraped at ``/metrics``.
With ``--otlp-endpoint`` they go to the collector as well, as they are at the moment
of each export: :class:`RegistryExporter` sits in front of the OTLP exporter and adds
one scope of metrics read from the registry to what the OpenTelemetry SDK collected
(OpenTelemetry's Python SDK has no metric producer interface for this yet).

A counter becomes a cumulative monotonic sum named as its family (``forkd_wakes``,
whose Prometheus sample is ``forkd_wakes_total``), a gauge a gauge, each sample's
labels its attributes. Histograms are not read here: each latency records into an
OpenTelemetry histogram of its own (:meth:`forkd.controller.metrics.Metrics.export_latencies`),
which keeps the minimum and maximum a Prometheus histogram lacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry

from forkd import __version__

SCOPE = InstrumentationScope("forkd.prometheus", __version__)
READ_TIMEOUT_S = 5.0  # the daemon's loop is busy past this: the export goes without them

log = logging.getLogger(__name__)


def read_registry(registry: CollectorRegistry, start_ns: int, now_ns: int) -> list[Metric]:
    """The counters and gauges in ``registry`` now, as OpenTelemetry metrics."""
    found: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            points = _points(family.samples, "_total", start_ns, now_ns)
            data: Any = Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=True)
        elif family.type == "gauge":
            data = Gauge(_points(family.samples, "", start_ns, now_ns))
        else:  # histograms have OpenTelemetry instruments of their own; no others are kept
            continue
        if data.data_points:
            found.append(Metric(family.name, family.documentation, None, data))
    return found


def _points(samples: Iterable[Any], suffix: str, start_ns: int, now_ns: int) -> list[Any]:
    """The samples named as their family (``suffix``: a counter's ``_total``), not the
    ``_created`` timestamps prometheus_client adds beside them."""
    return [
        NumberDataPoint(
            attributes=dict(sample.labels),
            start_time_unix_nano=start_ns,
            time_unix_nano=now_ns,
            value=sample.value,
        )
        for sample in samples
        if not suffix or sample.name.endswith(suffix)
    ]


class RegistryExporter(MetricExporter):
    """``exporter``, sending what the SDK collected and what the registry holds."""

    def __init__(self, exporter: MetricExporter, resource: Resource) -> None:
        super().__init__(
            preferred_temporality=exporter._preferred_temporality,
            preferred_aggregation=exporter._preferred_aggregation,
        )
        self._exporter = exporter
        self._resource = resource
        self._start_ns = time.time_ns()
        self._source: tuple[CollectorRegistry, asyncio.AbstractEventLoop] | None = None

    def read_from(self, registry: CollectorRegistry, loop: asyncio.AbstractEventLoop) -> None:
        """Add ``registry``'s metrics to each export from now on. Its gauges read the
        daemon's state (its database, its sandboxes), which only ``loop``'s thread
        touches: the registry is read there, not in the exporting thread."""
        self._source = (registry, loop)

    def stop_reading(self) -> None:
        self._source = None

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        read = self._read()
        if read:
            metrics_data = self._with(metrics_data, read)
        return self._exporter.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

    def _read(self) -> list[Metric]:
        """The registry's metrics, read on the daemon's loop; none if it cannot answer
        within :data:`READ_TIMEOUT_S` (or has stopped)."""
        source = self._source
        if source is None:
            return []
        registry, loop = source

        async def read() -> list[Metric]:
            return read_registry(registry, self._start_ns, time.time_ns())

        try:
            return asyncio.run_coroutine_threadsafe(read(), loop).result(READ_TIMEOUT_S)
        except Exception as exc:
            log.debug("the daemon's metrics were not read for this export: %r", exc)
            return []

    def _with(self, data: MetricsData, read: list[Metric]) -> MetricsData:
        scope = ScopeMetrics(SCOPE, read, "")
        resources = list(data.resource_metrics)
        if resources:
            first = resources[0]
            scopes = [*first.scope_metrics, scope]
            resources[0] = ResourceMetrics(first.resource, scopes, first.schema_url)
        else:
            resources.append(ResourceMetrics(self._resource, [scope], ""))
        return MetricsData(resources)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._exporter.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._exporter.shutdown(timeout_millis=timeout_millis, **kwargs)
