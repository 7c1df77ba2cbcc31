"""Spans of the daemon's own work (a fork, a restore, a branch's pause), for OpenTelemetry.

The daemon's code marks its steps with :func:`span` wherever it runs (the services,
the VM driver). Until :func:`install` is handed a tracer (``forkd serve
--otlp-endpoint``, :mod:`forkd.controller.otel`), a span is
:func:`contextlib.nullcontext`: nothing of OpenTelemetry is imported and a step costs
one function call. With a tracer, a span is a child of whatever span is current in
the task or thread (the API request's), since OpenTelemetry keeps the current span in
a context variable, which ``asyncio`` tasks and ``asyncio.to_thread`` carry along.

Attributes are the step's identifiers only (tags, sandbox ids, counts): never a
path a guest chose, an environment value or a command line.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

PREFIX = "forkd."  # every span of the daemon's steps is named forkd.<step>

AttributeValue = str | int | float | bool


class Tracer(Protocol):
    """What forkd needs of an OpenTelemetry tracer (``opentelemetry.trace.Tracer``)."""

    def start_as_current_span(
        self, name: str, *, attributes: Any = None
    ) -> contextlib.AbstractContextManager[Any]: ...


_tracer: Tracer | None = None


def install(tracer: Tracer) -> None:
    """From now on, :func:`span` records spans with ``tracer``."""
    global _tracer
    _tracer = tracer


def uninstall() -> None:
    """Spans are no-ops again (the daemon stopped its telemetry)."""
    global _tracer
    _tracer = None


def enabled() -> bool:
    return _tracer is not None


def span(step: str, **attributes: AttributeValue | None) -> contextlib.AbstractContextManager[Any]:
    """A span named ``forkd.<step>`` around a block; ``attributes`` that are None are
    left out. An exception leaving the block is recorded on the span and marks it an
    error (OpenTelemetry's default), then goes on."""
    tracer = _tracer
    if tracer is None:
        return contextlib.nullcontext()
    given = {f"forkd.{k}": v for k, v in attributes.items() if v is not None}
    return tracer.start_as_current_span(PREFIX + step, attributes=given)
