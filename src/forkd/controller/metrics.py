"""Prometheus metrics of one daemon (its own registry, scraped at /metrics)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from forkd import __version__
from forkd.controller.connection_limits import ConnectionCounts

if TYPE_CHECKING:
    from forkd.controller.models import SandboxMetrics

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30)


class Metrics:
    def __init__(
        self,
        snapshots: Callable[[], int],
        sandboxes: Callable[[], int],
        pooled: Callable[[], int] = lambda: 0,
        branches_in_flight: Callable[[], int] = lambda: 0,
        branch_cap: Callable[[], int] = lambda: 0,
        connections: Callable[[], ConnectionCounts] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()  # the daemon's own (also sent over OTLP)
        # Series labelled by sandbox: on /metrics only. Reading them keeps the guests'
        # figures fresh (forkd.controller.services.usage), which is a scrape's to ask for,
        # not every metrics export's; and an OpenTelemetry backend is no place for one
        # series per sandbox.
        self.sandbox_registry = CollectorRegistry()
        self._latencies: list[Latency] = []
        if connections is not None:
            self.registry.register(_ConnectionCollector(connections))
        self._gauges(snapshots, sandboxes, pooled, branches_in_flight, branch_cap)
        self.fork_seconds = self._latency(
            "forkd_fork_seconds", "Fork latency: QEMU start to agent answering"
        )
        self.branch_pause_seconds = self._latency(
            "forkd_branch_pause_seconds", "Pause window of a branch (vCPUs frozen)"
        )
        self.snapshot_seconds = self._latency(
            "forkd_template_snapshot_seconds", "Time to snapshot a template"
        )

        self.wakes = Counter(
            "forkd_wakes_total",
            "Sandboxes a request woke, by the state they woke from",
            ["from"],
            registry=self.registry,
        )
        self.wake_seconds = self._latency(
            "forkd_wake_seconds", "What waking a sandbox for a request added to its answer"
        )
        self.evictions = Counter(
            "forkd_evictions_total",
            "Idle sandboxes hibernated to give memory back (reclaim)",
            registry=self.registry,
        )
        self.registry_bytes = Counter(
            "forkd_registry_bytes",
            "Bytes sent to (push) and fetched from (pull) OCI registries",
            ["direction"],
            registry=self.registry,
        )

    def _gauges(
        self,
        snapshots: Callable[[], int],
        sandboxes: Callable[[], int],
        pooled: Callable[[], int],
        branches_in_flight: Callable[[], int],
        branch_cap: Callable[[], int],
    ) -> None:
        """The counts read when the metrics are asked for, and the build's version."""
        self._gauge("forkd_snapshots_total", "Snapshots registered", snapshots)
        self._gauge("forkd_sandboxes_active", "Sandboxes running", sandboxes)
        self._gauge(
            "forkd_pool_waiting", "QEMU processes started ahead, waiting for a fork", pooled
        )
        # The original contract's two branch gauges.
        self._gauge("forkd_branches_in_flight", "Branches being taken now", branches_in_flight)
        cap_help = "Branches that may be in flight at once (the cap)"
        self._gauge("forkd_branch_concurrency_cap", cap_help, branch_cap)
        info = Gauge("forkd_build_info", "forkd build", ["version"], registry=self.registry)
        info.labels(version=__version__).set(1)

    def _gauge(self, name: str, help_text: str, value: Callable[[], int]) -> None:
        """A gauge read from ``value`` whenever the metrics are asked for."""
        Gauge(name, help_text, registry=self.registry).set_function(value)

    def _latency(self, name: str, help_text: str) -> Latency:
        """A histogram of seconds, in the buckets of every latency here."""
        found = Latency(name, help_text, self.registry)
        self._latencies.append(found)
        return found

    def export_latencies(self, meter: Any) -> None:
        """Record every latency in an OpenTelemetry histogram of ``meter`` too, with the
        same name and buckets (``forkd serve --otlp-endpoint``): the counters and gauges
        are read from this registry when exported (:mod:`forkd.controller.otel`), but a
        Prometheus histogram keeps no minimum and maximum, which OTLP's carries."""
        for latency in self._latencies:
            latency.export_to(meter)

    def observe_wake(self, was: str, secs: float) -> None:
        """A sandbox woke from ``was`` (paused, hibernated) for a request in ``secs``."""
        self.wakes.labels(**{"from": was}).inc()
        self.wake_seconds.observe(secs)

    def observe_eviction(self) -> None:
        """Reclaim hibernated an idle sandbox."""
        self.evictions.inc()

    def watch_egress(self, read: Callable[[], dict[str, Any]], cap: int) -> None:
        """Per-sandbox egress counters (forkd.egress.records.EgressCounts by sandbox)."""
        self.sandbox_registry.register(_EgressCollector(read, cap))

    def watch_sandboxes(self, read: Callable[[], list[SandboxMetrics]], cap: int) -> None:
        """Series labelled by sandbox, from ``read()``, for at most ``cap`` sandboxes."""
        self.sandbox_registry.register(_SandboxCollector(read, cap))

    def render(self) -> bytes:
        both = generate_latest(self.registry) + generate_latest(self.sandbox_registry)
        return integral_counts(both)


class Latency:
    """A latency in seconds: a Prometheus histogram, and an OpenTelemetry one once
    :meth:`export_to` is given a meter."""

    def __init__(self, name: str, help_text: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.help_text = help_text
        self._histogram = Histogram(name, help_text, buckets=LATENCY_BUCKETS, registry=registry)
        self._exported: Any = None  # an opentelemetry.metrics.Histogram

    def export_to(self, meter: Any) -> None:
        self._exported = meter.create_histogram(
            self.name,
            unit="s",
            description=self.help_text,
            explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS),
        )

    def observe(self, secs: float) -> None:
        self._histogram.observe(secs)
        if self._exported is not None:
            self._exported.record(secs)


_WHOLE = re.compile(rb"^(?P<sample>[a-zA-Z_:][\w:]*(?:\{.*\})?) (?P<value>-?\d+)\.0$")


def integral_counts(text: bytes) -> bytes:
    """``text`` (the exposition format) with counts as integers (``forkd_snapshots_total 3``,
    as the original forkd printed them, not prometheus_client's ``3.0``). Every metric
    here is a count but the histograms' sums (seconds) and creation times."""
    lines = []
    for line in text.split(b"\n"):
        match = _WHOLE.match(line)
        name = match["sample"].split(b"{", 1)[0] if match else b""
        if match and not name.endswith((b"_sum", b"_created")):
            line = match["sample"] + b" " + match["value"]
        lines.append(line)
    return b"\n".join(lines)


class _ConnectionCollector(Collector):
    """The server's client connections: open, refused over a cap, closed for a request
    that did not come in time (:mod:`forkd.controller.connection_limits`)."""

    def __init__(self, counts: Callable[[], ConnectionCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        yield GaugeMetricFamily(
            "forkd_connections_open", "Client connections open (WebSockets too)", counts.open
        )
        refused = CounterMetricFamily(
            "forkd_connections_refused",
            "Connections refused at once: over a cap",
            labels=["cap"],
        )
        for cap, n in counts.refused.items():
            refused.add_metric([cap], n)
        yield refused
        timed_out = CounterMetricFamily(
            "forkd_connections_timed_out",
            "Connections closed: a request head, or a byte of its body, did not come in time",
            labels=["wait"],
        )
        for wait, n in counts.timed_out.items():
            timed_out.add_metric([wait], n)
        yield timed_out
        yield CounterMetricFamily(
            "forkd_connections_closed_for_another",
            "Idle connections without the token closed to let a new connection in",
            value=counts.closed_for_another,
        )


Family = CounterMetricFamily | GaugeMetricFamily


class _EgressCollector(Collector):
    """Each sandbox's egress through the proxy, labelled by its id (the ``cap`` busiest)."""

    SERIES = (
        (
            "forkd_sandbox_egress_allowed",
            "Connections and HTTP requests the proxy let out",
            "allowed",
        ),
        (
            "forkd_sandbox_egress_refused",
            "Connections and HTTP requests the proxy refused",
            "refused",
        ),
        (
            "forkd_sandbox_egress_sent_bytes",
            "Bytes the guest sent out through the proxy",
            "bytes_out",
        ),
        (
            "forkd_sandbox_egress_received_bytes",
            "Bytes the guest received through the proxy",
            "bytes_in",
        ),
        ("forkd_sandbox_egress_substitutions", "Requests a secret was put in", "substitutions"),
    )

    def __init__(self, read: Callable[[], dict[str, Any]], cap: int) -> None:
        self._read = read
        self._cap = cap

    def describe(self) -> Iterator[Metric]:
        for name, text, _ in self.SERIES:
            yield CounterMetricFamily(name, text)

    def collect(self) -> Iterator[Metric]:
        counts = self._read()
        busiest = sorted(counts, key=lambda sid: -counts[sid].allowed - counts[sid].refused)
        for name, text, field in self.SERIES:
            family = CounterMetricFamily(name, text, labels=["sandbox"])
            for sid in busiest[: self._cap]:
                family.add_metric([sid], getattr(counts[sid], field))
            yield family


class _SandboxCollector(Collector):
    """Each sandbox's figures (forkd.controller.services.usage), labelled by its id: the
    ``cap`` sandboxes that hold the most host memory, then the rest, left out and counted
    in ``forkd_sandbox_series_omitted`` so that a host of thousands keeps a bounded
    number of series."""

    # (series, its family, help, the figure of a SandboxMetrics)
    SERIES: tuple[tuple[str, type[Family], str, Callable[[SandboxMetrics], float | None]], ...] = (
        (
            "forkd_sandbox_cpu_seconds",
            CounterMetricFamily,
            "CPU time its QEMU used",
            lambda m: m.cpu.seconds,
        ),
        (
            "forkd_sandbox_memory_host_private_bytes",
            GaugeMetricFamily,
            "What its QEMU holds of its own",
            lambda m: m.memory.host_private_bytes,
        ),
        (
            "forkd_sandbox_memory_guest_used_bytes",
            GaugeMetricFamily,
            "Memory its guest uses",
            lambda m: m.memory.guest_used_bytes,
        ),
        (
            "forkd_sandbox_disk_used_bytes",
            GaugeMetricFamily,
            "Used on its guest's root filesystem",
            lambda m: m.disk.used_bytes if m.disk else None,
        ),
        (
            "forkd_sandbox_network_rx_bytes",
            CounterMetricFamily,
            "Bytes its guest received",
            lambda m: m.network.rx_bytes if m.network else None,
        ),
        (
            "forkd_sandbox_network_tx_bytes",
            CounterMetricFamily,
            "Bytes its guest sent",
            lambda m: m.network.tx_bytes if m.network else None,
        ),
        (
            "forkd_sandbox_processes",
            GaugeMetricFamily,
            "Processes running in its guest",
            lambda m: m.processes,
        ),
        ("forkd_sandbox_wakes", CounterMetricFamily, "Times a request woke it", lambda m: m.wakes),
        (
            "forkd_sandbox_evictions",
            CounterMetricFamily,
            "Times reclaim hibernated it",
            lambda m: m.evictions,
        ),
    )

    def __init__(self, read: Callable[[], list[SandboxMetrics]], cap: int) -> None:
        self._read = read
        self._cap = cap

    def describe(self) -> Iterator[Metric]:  # what register() asks: no reading for it
        for name, family, text, _ in self.SERIES:
            yield family(name, text)
        yield GaugeMetricFamily("forkd_sandbox_series_omitted", "over the cap")

    def collect(self) -> Iterator[Metric]:
        every = sorted(self._read(), key=lambda m: -(m.memory.host_private_bytes or 0))
        shown = every[: self._cap]
        for name, family, text, figure in self.SERIES:
            series = family(name, text, labels=["sandbox"])
            for m in shown:
                value = figure(m)
                if value is not None:
                    series.add_metric([m.sandbox_id], value)
            yield series
        yield GaugeMetricFamily(
            "forkd_sandbox_series_omitted",
            "Sandboxes left out of the per-sandbox series (over the cap)",
            len(every) - len(shown),
        )
