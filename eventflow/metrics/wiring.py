"""``Observability``: what an ``App`` turns on to be seen: its Prometheus metrics, its
OpenTelemetry instruments and its HTTP port, in one place so the app keeps a few lines.

The app makes one at construction and calls :meth:`start` (before its subscriptions
join: ``/readyz`` answers "starting" meanwhile) and :meth:`attach` (with its consumers,
once made). ``prometheus_client`` is imported only when Prometheus metrics are on, and
``opentelemetry`` only with a ``meter_provider``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from ..runtime.consumer import Consumer
from ..runtime.health import readiness_body
from ..runtime.http import HttpServer, Response
from ..sagas.runtime import SagaRuntime
from ..supervision import Supervisor
from . import PROMETHEUS_MISSING, prometheus_available
from .collect import MetricsHost, Sampler

if TYPE_CHECKING:
    from .otel import OtelMetrics
    from .registry import AppMetrics

__all__ = ["Observability"]

Hook = Callable[[float], None]


class Observability:
    """One app's metrics and HTTP port (see the module docstring)."""

    def __init__(
        self,
        app: MetricsHost,
        sagas: SagaRuntime,
        *,
        name: str,
        metrics: bool | None,
        meter_provider: Any = None,
    ) -> None:
        if metrics and not prometheus_available():
            raise ImportError(f"App(metrics=True): {PROMETHEUS_MISSING}")
        self.app = app
        self.sagas = sagas
        self.name = name
        self.want_metrics = metrics
        self.meter_provider = meter_provider
        self.metrics: AppMetrics | None = None
        self.otel: OtelMetrics | None = None
        self.http: HttpServer | None = None

    async def start(self, supervisor: Supervisor, host: str, port: int | None) -> None:
        """Make the metrics (once: they outlive restarts) and bind the port, if any."""
        wanted = self.want_metrics
        if wanted is None:
            wanted = port is not None and prometheus_available()
        if wanted and self.metrics is None:
            from .registry import AppMetrics

            self.metrics = AppMetrics(self.app, self.sagas)
        if self.meter_provider is not None and self.otel is None:
            from .otel import OtelMetrics

            sampler = self.metrics.sampler if self.metrics is not None else None
            self.otel = OtelMetrics(sampler or Sampler(self.app, self.sagas), self.meter_provider)
        self.http = None
        if port is None:
            return
        routes = {"/healthz": self._healthz, "/readyz": self._readyz, "/metrics": self._scrape}
        server = HttpServer(host, port, routes, name=self.name)
        await server.open()
        self.http = server
        supervisor.spawn("http server", server.serve)

    def attach(self, supervisor: Supervisor, consumers: Sequence[Consumer]) -> None:
        """Give each consumer the per-message hooks of whatever metrics are on; with OTel,
        start the component that refreshes its gauges (from the consumers' start on)."""
        if self.otel is not None:
            supervisor.spawn("metrics sampler", self.otel.run)
        for consumer in consumers:
            pairs = [m.hooks(consumer) for m in (self.metrics, self.otel) if m is not None]
            if len(pairs) == 1:
                consumer.observe(*pairs[0])
            elif pairs:
                consumer.observe(_both(pairs[0][0], pairs[1][0]), _both(pairs[0][1], pairs[1][1]))

    async def _healthz(self) -> Response:
        return Response(200, b"ok\n")

    async def _readyz(self) -> Response:
        ready, health = self.app.readiness()
        body = readiness_body(self.name, health)
        return Response(200 if ready else 503, orjson.dumps(body), "application/json")

    async def _scrape(self) -> Response:
        metrics = self.metrics
        if metrics is None:
            why = PROMETHEUS_MISSING if not prometheus_available() else "App(metrics=False)"
            return Response(503, f"no metrics: {why}\n".encode())
        body, content_type = await metrics.exposition()
        return Response(200, body, content_type)


def _both(first: Hook, second: Hook) -> Hook:
    def both(seconds: float) -> None:
        first(seconds)
        second(seconds)

    return both
