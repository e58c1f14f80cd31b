"""Metrics of an app, exported for Prometheus (``pip install 'eventflow[prometheus]'``).

``App(http_port=9464)`` serves them at ``/metrics`` (with ``/healthz`` and ``/readyz``,
see ``eventflow.runtime.http``); ``App(metrics=True)`` keeps them without a port, in
``app.metrics.registry``. ``names`` lists every metric; ``collect`` takes the scrape-time
readings; ``registry`` (the only module that imports ``prometheus_client``) builds the
families. Nothing here is imported by the core unless metrics are on.
"""

from __future__ import annotations

import importlib.util

__all__ = ["PROMETHEUS_MISSING", "prometheus_available"]

PROMETHEUS_MISSING = (
    "metrics need the prometheus extra: pip install 'eventflow[prometheus]' "
    "(then /metrics serves them)"
)


def prometheus_available() -> bool:
    """True when ``prometheus_client`` can be imported (without importing it)."""
    return importlib.util.find_spec("prometheus_client") is not None
