"""No ids in labels (issue 22 item 2): every metric an app exports, for Prometheus and
through OpenTelemetry, is labelled only by names (group, topic pattern, partition,
projection, saga class, status, the part a scrape read), and no label value is an id the
app handled (a message, correlation, stream, saga, dead letter or instance id)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from eventflow import (
    App,
    Context,
    Event,
    Projection,
    ProjectionContext,
    Reject,
    Saga,
    on,
    step,
    subscribe,
)
from eventflow.metrics import names

Wait = Callable[..., Awaitable[None]]

# The only label names a metric may carry; `le` is a histogram bucket's bound.
NAMES = {"group", "topic", "partition", "projection", "saga", "status", "part"}
BUCKET = {"le"}
# Series the memory broker has none of (no partitions) or that appear only on a failure.
NOT_ON_MEMORY = {
    names.PARTITION_LAG_MESSAGES,
    names.PARTITION_LAG_SECONDS,
    names.COLLECT_ERRORS,
}


class LabelOrder(Event, type="it.labels.order"):
    order_id: str


class LabelCharged(Event, type="it.labels.charged"):
    order_id: str


class LabelCharge(Event, type="it.labels.charge"):
    order_id: str


class LabelSaga(Saga, name="it_labels_saga", start=LabelOrder, key="order_id"):
    order_id: str = ""

    def started(self, e: LabelOrder) -> None:
        self.order_id = e.order_id

    @step(reply=LabelCharged, timeout=600.0)
    def charge(self) -> Event:
        return LabelCharge(order_id=self.order_id)


class LabelView(Projection, name="it_labels_view"):
    @on(LabelOrder)
    async def _order(self, event: LabelOrder, ctx: ProjectionContext) -> None: ...


async def test_no_metric_is_labelled_by_an_id(
    broker_url: str, tmp_path: Path, waiter: Wait
) -> None:
    @subscribe("it.labels.order", group="billing")
    async def bill(event: LabelOrder, ctx: Context) -> None:
        if event.order_id == "o-2":
            raise Reject("o-2 is refused")
        async with ctx.transaction():
            await ctx.store.append(f"bill-{event.order_id}", [LabelCharge(order_id=event.order_id)])

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    app = App(
        "it-labels",
        broker=broker_url,
        store=f"sqlite:///{tmp_path}/labels.db",
        handlers=[bill],
        projections=[LabelView()],
        sagas=[LabelSaga],
        http_port=0,
        http_host="127.0.0.1",
        meter_provider=provider,
    )
    try:
        async with app:
            sent = [
                await app.publish(LabelOrder(order_id=f"o-{n}"), key=f"o-{n}") for n in range(4)
            ]
            await app.store.append("order-o-9", [LabelOrder(order_id="o-9")])

            async def settled() -> bool:
                letters = await app.dead_letters.list()
                sagas = await app.sagas.list(name="it_labels_saga")
                return len(letters) == 1 and len(sagas) == 4

            await waiter(settled, what="a dead letter and four sagas")
            ids = {app.instance}
            ids |= {e.id for e in sent} | {e.correlation_id for e in sent}
            ids |= {e.data["order_id"] for e in sent} | {"order-o-9", "o-9"}
            ids |= {f"bill-{e.data['order_id']}" for e in sent}
            ids |= {letter.id for letter in await app.dead_letters.list()}
            ids |= {s.id for s in await app.sagas.list(name="it_labels_saga")}

            assert app.metrics is not None and app.http_address is not None
            app.metrics.sampler.min_interval = 0.0
            async with httpx.AsyncClient() as client:
                response = await client.get(f"http://127.0.0.1:{app.http_address[1]}/metrics")
            assert response.status_code == 200
            seen: set[str] = set()
            for family in text_string_to_metric_families(response.text):
                for s in family.samples:
                    if not s.name.startswith("eventflow_"):
                        continue  # the client library's own (process, platform)
                    seen.add(s.name)
                    allowed = NAMES | (BUCKET if s.name.endswith("_bucket") else set())
                    assert set(s.labels) <= allowed, (s.name, s.labels)
                    assert not ids & set(s.labels.values()), (s.name, s.labels)
            assert seen == names.EXPORTED - NOT_ON_MEMORY

            # Through OpenTelemetry: the same attribute names, no id among the values.
            data = reader.get_metrics_data()
            assert data is not None
            instruments = 0
            for resource in data.resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        instruments += 1
                        for point in metric.data.data_points:
                            attributes = dict(point.attributes or {})
                            assert set(attributes) <= NAMES, (metric.name, attributes)
                            assert not ids & {str(v) for v in attributes.values()}, metric.name
            assert instruments > 10
    finally:
        provider.shutdown()
