"""The app's HTTP port: ``/metrics`` scraped over HTTP and read with the Prometheus text
parser (counters and histograms move as messages are handled; the DLQ and projection
gauges follow the store), and ``/readyz`` unready before the subscriptions are live and
after a component failed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from eventflow import (
    App,
    Context,
    Event,
    Projection,
    ProjectionContext,
    Reject,
    RetryPolicy,
    Saga,
    on,
    step,
    subscribe,
)
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig
from eventflow.adapters.sqlite import SqliteStore
from eventflow.ports import Delivery, StartPosition, Subscription
from eventflow.runtime.relay import OUTBOX_RELAY_LEASE
from eventflow.supervision import RestartPolicy

Wait = Callable[..., Awaitable[None]]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
FAST_RETRY = RetryPolicy(max_attempts=3, initial_delay=0.001, max_delay=0.002)


class Order(Event, type="it.metrics.order"):
    n: int


class Stocked(Event, type="it.metrics.stocked"):
    n: int


async def scrape(app: App) -> Samples:
    """GET /metrics over HTTP and parse it: (sample name, sorted labels) -> value. (Each
    scrape reads the gauges afresh: the app reuses a reading for a second by default.)"""
    assert app.metrics is not None
    app.metrics.sampler.min_interval = 0.0
    text = await get(app, "/metrics", expect=200)
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


async def get(app: App, path: str, *, expect: int) -> str:
    address = app.http_address
    assert address is not None, "the app has no HTTP port open"
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{address[1]}{path}")
    assert response.status_code == expect, (path, response.status_code, response.text)
    return response.text


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_counters_and_histograms_move_as_messages_are_handled(
    broker_url: str, waiter: Wait
) -> None:
    seen: dict[int, int] = {}

    @subscribe("it.metrics.order", group="billing", retry=FAST_RETRY)
    async def bill(event: Order) -> None:
        seen[event.n] = seen.get(event.n, 0) + 1
        if event.n == 1 and seen[1] == 1:
            raise RuntimeError("first attempt of order 1 fails")
        if event.n == 2:
            raise Reject("order 2 is refused")

    app = App(
        "it-metrics",
        broker=broker_url,
        handlers=[bill],
        http_port=0,
        http_host="127.0.0.1",
    )
    async with app:
        labels = {"group": "billing", "topic": "it.metrics.order"}
        before = await scrape(app)
        # Every series of the subscription exists from its start, lag included.
        assert value(before, "eventflow_messages_handled_total", **labels) == 0
        assert value(before, "eventflow_handler_duration_seconds_count", **labels) == 0
        assert value(before, "eventflow_consumer_lag_messages", **labels) == 0
        assert value(before, "eventflow_consumer_lag_seconds", **labels) == 0
        assert value(before, "eventflow_ready") == 1
        sent = [await app.publish(Order(n=n), key=f"k{n}") for n in range(5)]

        async def settled() -> bool:
            stats = app.consumers[0].stats
            return stats.handled == 4 and stats.dead_lettered == 1

        await waiter(settled, what="4 handled and 1 dead-lettered")
        after = await scrape(app)
        assert value(after, "eventflow_messages_received_total", **labels) == 5
        assert value(after, "eventflow_messages_handled_total", **labels) == 4
        # Two failed attempts: order 1's first (retried), order 2's (rejected).
        assert value(after, "eventflow_messages_failed_total", **labels) == 2
        assert value(after, "eventflow_messages_retried_total", **labels) == 1
        assert value(after, "eventflow_messages_dead_lettered_total", **labels) == 1
        assert value(after, "eventflow_messages_deduplicated_total", **labels) == 0
        # One observation per attempt (6: five messages, order 1 twice), one per handled.
        assert value(after, "eventflow_handler_duration_seconds_count", **labels) == 6
        assert value(after, "eventflow_handler_duration_seconds_bucket", le="+Inf", **labels) == 6
        assert value(after, "eventflow_handler_duration_seconds_sum", **labels) > 0
        assert value(after, "eventflow_message_end_to_end_seconds_count", **labels) == 4
        assert value(after, "eventflow_dead_letter_queue_messages", group="billing") == 1
        assert value(after, "eventflow_outbox_pending_messages") == 0

        # A copy of a handled message is counted as deduplicated; a replayed dead letter
        # refused again is dead-lettered again, and the DLQ still holds one.
        await app.publish(sent[0])
        [letter] = await app.dead_letters.list()
        await app.dead_letters.replay([letter.id])
        await waiter(lambda: app.consumers[0].stats.received == 7, what="the copy and replay")
        await waiter(lambda: app.consumers[0].stats.dead_lettered == 2, what="refused again")
        again = await scrape(app)
        assert value(again, "eventflow_messages_deduplicated_total", **labels) == 1
        assert value(again, "eventflow_messages_dead_lettered_total", **labels) == 2
        assert value(again, "eventflow_dead_letter_queue_messages", group="billing") == 1


class Stock(Projection, name="it_metrics_stock"):
    """A projection that cannot get past event 2 (a poison event)."""

    @on(Stocked)
    async def _stocked(self, event: Stocked, ctx: ProjectionContext) -> None:
        if event.n == 2:
            raise RuntimeError("cannot project event 2")


async def test_projection_lag_grows_behind_a_poison_event(broker_url: str, waiter: Wait) -> None:
    app = App(
        "it-metrics-proj",
        broker=broker_url,
        projections=[Stock()],
        http_port=0,
        http_host="127.0.0.1",
        metrics=True,
    )
    async with app:
        for n in range(1, 5):
            await app.store.append(f"s-{n}", [Stocked(n=n)])

        async def stalled() -> bool:
            return await app.store.checkpoints.get("it_metrics_stock") == 1

        await waiter(stalled, what="the projection stuck after event 1")
        found = await scrape(app)
        name = {"projection": "it_metrics_stock"}
        assert value(found, "eventflow_projection_lag_positions", **name) == 3
        assert value(found, "eventflow_projection_lag_seconds", **name) > 0


class _GatedSubscription:
    """A real subscription whose ``fetch`` raises what its broker says to, once set."""

    def __init__(self, broker: GatedBroker, inner: Subscription) -> None:
        self._broker = broker
        self._inner = inner
        self.pattern = inner.pattern
        self.group = inner.group

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery]:
        if self._broker.error is not None:
            raise self._broker.error
        return await self._inner.fetch(max_messages, timeout)

    async def close(self) -> None:
        await self._inner.close()


class GatedBroker(MemoryBroker):
    """The memory broker, whose joins wait for ``gate`` and whose subscriptions' fetches
    raise ``error`` once the test sets it (an adapter bug: not transient)."""

    def __init__(self, name: str) -> None:
        super().__init__(MemoryBrokerConfig(name=name))
        self.gate = asyncio.Event()
        self.error: Exception | None = None

    async def subscribe(
        self, pattern: str, *, group: str, start: StartPosition = "latest"
    ) -> Subscription:
        await self.gate.wait()
        inner = await super().subscribe(pattern, group=group, start=start)
        return _GatedSubscription(self, inner)


async def test_readyz_is_unready_before_subscriptions_are_live_and_after_a_failure(
    broker_name: str, waiter: Wait
) -> None:
    @subscribe("it.metrics.order", group="ready")
    async def handle(event: Order) -> None: ...

    broker = GatedBroker(broker_name)
    app = App(
        "it-metrics-ready",
        broker=broker,
        handlers=[handle],
        http_port=0,
        http_host="127.0.0.1",
        restart_policy=RestartPolicy(initial_delay=0.01, max_delay=0.05),
    )
    starting = asyncio.ensure_future(app.start())
    try:
        await waiter(lambda: app.http_address is not None, what="the port open")
        assert await get(app, "/healthz", expect=200) == "ok\n"
        body = await get(app, "/readyz", expect=503)
        assert '"status":"starting"' in body
        assert not starting.done()  # the subscription is still joining
        broker.gate.set()
        await starting
        assert '"status":"ok"' in await get(app, "/readyz", expect=200)

        broker.error = RuntimeError("adapter bug")
        await waiter(lambda: app.failure is not None, what="the consumer fails")
        body = await get(app, "/readyz", expect=503)
        assert '"status":"failed"' in body and "adapter bug" in body
        assert await get(app, "/healthz", expect=200) == "ok\n"  # the loop still answers
        found = await scrape(app)
        assert value(found, "eventflow_ready") == 0
    finally:
        starting.cancel()
        await asyncio.wait({starting})
        await app.stop()
    assert app.http_address is None


async def test_a_port_in_use_fails_the_start_naming_it(broker_url: str) -> None:
    first = App("it-metrics-a", broker=broker_url, http_port=0, http_host="127.0.0.1")
    async with first:
        address = first.http_address
        assert address is not None
        second = App("it-metrics-b", broker=broker_url, http_port=address[1], http_host="127.0.0.1")
        try:
            await second.start()
        except Exception as exc:
            assert f"127.0.0.1:{address[1]}" in str(exc) and "http_port" in str(exc)
        else:
            await second.stop()
            raise AssertionError("a second app bound the same port")


class ProbeStarted(Event, type="it.metrics.probe.started"):
    probe_id: str


class Ping(Event, type="it.metrics.probe.ping"):
    probe_id: str


class Pong(Event, type="it.metrics.probe.pong"):
    probe_id: str


class ProbeSaga(Saga, name="it_metrics_probe", start=ProbeStarted, key="probe_id"):
    probe_id: str = ""

    def started(self, e: ProbeStarted) -> None:
        self.probe_id = e.probe_id

    @step(reply=Pong, timeout=600.0)
    def ping(self) -> Event:
        return Ping(probe_id=self.probe_id)


async def test_sagas_by_status_and_their_timers(broker_url: str, waiter: Wait) -> None:
    app = App(
        "it-metrics-sagas",
        broker=broker_url,
        sagas=[ProbeSaga],
        http_port=0,
        http_host="127.0.0.1",
    )
    async with app:
        for n in range(3):
            await app.publish(ProbeStarted(probe_id=f"p{n}"))

        async def started() -> bool:
            return len(await app.sagas.list(name="it_metrics_probe")) == 3

        await waiter(started, what="three sagas waiting for their reply")
        found = await scrape(app)
        saga = {"saga": "it_metrics_probe"}
        assert value(found, "eventflow_sagas", status="running", **saga) == 3
        assert value(found, "eventflow_saga_timers_pending", **saga) == 3
        assert value(found, "eventflow_saga_timers_overdue_seconds", **saga) == 0
        assert value(found, "eventflow_store_append_conflicts_total") == 0


async def test_outbox_pending_and_its_oldest_age(
    broker_url: str, tmp_path: Path, waiter: Wait
) -> None:
    """Rows committed to the outbox while another instance holds the relay's lease (so
    nothing relays them) are counted, their oldest's age grows, and both fall to 0 once
    the lease is free and this app's relay sends them."""
    store_url = f"sqlite:///{tmp_path / 'outbox.db'}?lease_ttl=1"
    received: list[int] = []

    @subscribe("it.metrics.order", group="stock")
    async def reserve(event: Order, ctx: Context) -> None:
        async with ctx.transaction():
            for n in range(3):
                await ctx.publish(Stocked(n=n))

    @subscribe("it.metrics.stocked", group="count")
    async def count(event: Stocked) -> None:
        received.append(event.n)

    other = SqliteStore.from_url(store_url)
    await other.open()
    app = App(
        "it-metrics-outbox",
        broker=broker_url,
        store=store_url,
        handlers=[reserve, count],
        http_port=0,
        http_host="127.0.0.1",
    )
    try:
        # Taken before the app starts, so its relay waits for it.
        holding = other.leases.hold(OUTBOX_RELAY_LEASE)
        await holding.__aenter__()
        async with app:
            try:
                await app.publish(Order(n=1), key="k")
                await waiter(lambda: app.consumers[0].stats.handled == 1, what="reserve ran")
                found = await scrape(app)
                assert value(found, "eventflow_outbox_pending_messages") == 3
                first = value(found, "eventflow_outbox_oldest_seconds")
                assert first > 0

                async def older() -> bool:
                    later = await scrape(app)
                    return value(later, "eventflow_outbox_oldest_seconds") >= first + 1.0

                await waiter(older, what="the oldest row's age growing")
                assert received == []
            finally:
                await holding.__aexit__(None, None, None)
            await waiter(lambda: len(received) == 3, timeout=20, what="the relay sent them")

            async def empty() -> bool:
                now = await scrape(app)
                pending = value(now, "eventflow_outbox_pending_messages")
                return pending == 0 and value(now, "eventflow_outbox_oldest_seconds") == 0

            await waiter(empty, what="pending and oldest back to 0")
    finally:
        await other.close()
