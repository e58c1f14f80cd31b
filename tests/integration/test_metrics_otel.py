"""``App(meter_provider=...)``: the metrics through OpenTelemetry, read with the SDK's
in-memory reader: counters and histograms move as messages are handled, lag gauges exist
from the start, and names and attributes are those of the Prometheus export."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from eventflow import App, Context, Event, subscribe

Wait = Callable[..., Awaitable[None]]


class Tock(Event, type="it.otel.metrics.tock"):
    n: int


def _points(reader: InMemoryMetricReader) -> dict[str, dict[tuple[tuple[str, Any], ...], Any]]:
    """instrument name -> attributes -> data point."""
    found: dict[str, dict[tuple[tuple[str, Any], ...], Any]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points = found.setdefault(metric.name, {})
                for point in metric.data.data_points:
                    points[tuple(sorted(point.attributes.items()))] = point
    return found


async def test_metrics_reach_an_opentelemetry_meter_provider(broker_url: str, waiter: Wait) -> None:
    @subscribe("it.otel.metrics.tock", group="otel")
    async def handle(event: Tock, ctx: Context) -> None:
        if event.n == 0 and ctx.attempt == 1:
            raise RuntimeError("the first attempt of tock 0 fails")

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    app = App("it-otel-metrics", broker=broker_url, handlers=[handle], meter_provider=provider)
    try:
        async with app:
            labels = (("group", "otel"), ("topic", "it.otel.metrics.tock"))
            # The gauges report the sampler component's reading, taken once the
            # subscriptions are live (then every 15 s): the lag series exist from the start.
            await waiter(
                lambda: labels in _points(reader).get("eventflow_consumer_lag_messages", {}),
                what="the first reading of the lag",
            )
            before = _points(reader)
            assert before["eventflow_messages_handled"][labels].value == 0
            assert before["eventflow_consumer_lag_messages"][labels].value == 0
            assert before["eventflow_consumer_lag"][labels].value == 0
            assert before["eventflow_ready"][()].value == 1
            for n in range(3):
                await app.publish(Tock(n=n))
            await waiter(lambda: app.consumers[0].stats.handled == 3, what="3 handled")
            assert app.metrics is None  # no Prometheus without a port
            after = _points(reader)
            assert after["eventflow_messages_handled"][labels].value == 3
            assert after["eventflow_messages_failed"][labels].value == 1
            assert after["eventflow_messages_retried"][labels].value == 1
            assert after["eventflow_handler_duration"][labels].count == 4
            assert after["eventflow_message_end_to_end"][labels].count == 3
    finally:
        provider.shutdown()
