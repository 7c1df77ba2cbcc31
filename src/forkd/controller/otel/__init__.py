"""OpenTelemetry export of the daemon's traces and metrics (``forkd serve --otlp-endpoint``).

Imported only when that flag is given (:mod:`.telemetry`); the spans' marks in the
daemon's code are :mod:`forkd.tracing`, which needs none of it.
"""
