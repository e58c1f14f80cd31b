"""``app.request`` (DESIGN 3c) on the memory broker, NATS and Kafka (Tansu).

The asking app and the participant are separate ``App`` objects (separate brokers, stores
and groups; on NATS and Kafka one server), as two services are; the participant answers
with an ordinary ``ctx.publish``. The one-process-per-service case on NATS is in
``tests/faults/test_request_processes.py``.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

import eventflow
from eventflow import App, Context, Envelope, Event, RequestTimeoutError, subscribe
from eventflow.adapters.memory import MemoryBroker
from eventflow.testing.kafka_server import fast_test_url, kafka_service_url
from eventflow.testing.nats_server import nats_service_url

Wait = Callable[..., Any]


class ReserveStock(Event, type="reqtest.stock.reserve"):
    order_id: str
    sku: str = "sku-1"
    qty: int = 1


class StockReserved(Event, type="reqtest.stock.reserved"):
    order_id: str
    left: int


class StockRejected(Event, type="reqtest.stock.rejected"):
    order_id: str
    reason: str


class StockChecked(Event, type="reqtest.stock.checked"):
    """Published by the participant before its answer: caused by the command, not a reply."""

    order_id: str


@dataclass
class Participant:
    """How the inventory answers, and what it received."""

    reject: set[str] = field(default_factory=set)
    hold: dict[str, asyncio.Event] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)
    received: list[str] = field(default_factory=list)

    def handlers(self, group: str) -> list[Any]:
        """The inventory's handler in ``group``."""

        @subscribe(ReserveStock.event_type, group=group, concurrency=4)
        async def reserve(cmd: ReserveStock, ctx: Context) -> None:
            self.received.append(cmd.order_id)
            if cmd.order_id in self.silent:
                return
            held = self.hold.get(cmd.order_id)
            if held is not None:
                await held.wait()
            # Caused by the command too, on the reply's own topic and on its own: neither
            # is a reply (their type is not expected).
            await ctx.publish(StockChecked(order_id=cmd.order_id))
            await ctx.publish(StockChecked(order_id=cmd.order_id), topic=StockReserved.event_type)
            if cmd.order_id in self.reject:
                async with ctx.transaction():  # through the outbox and its relay
                    await ctx.publish(StockRejected(order_id=cmd.order_id, reason="short"))
                return
            await ctx.publish(StockReserved(order_id=cmd.order_id, left=10 - cmd.qty))

        return [reserve]


@dataclass
class Place:
    """Where one test's apps meet."""

    broker: str
    unique: str

    def app(self, name: str, **kwargs: Any) -> App:
        return App(name, broker=self.broker, **kwargs)


@pytest.fixture(scope="module")
def request_nats_url() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture(scope="module")
def request_kafka_url() -> Iterator[str]:
    with kafka_service_url() as url:
        yield fast_test_url(url)


@pytest.fixture(
    params=[
        pytest.param("memory", id="memory"),
        pytest.param("nats", id="nats", marks=pytest.mark.service("nats")),
        pytest.param("kafka", id="kafka", marks=pytest.mark.service("kafka")),
    ]
)
def place(request: pytest.FixtureRequest, broker_url: str, hub: MemoryBroker) -> Place:
    """The test's broker: a memory hub, a NATS stream or a Kafka topic prefix of its own."""
    unique = uuid.uuid4().hex[:10]
    if request.param == "memory":
        return Place(broker_url, unique)
    if request.param == "nats":
        nats = request.getfixturevalue("request_nats_url")
        return Place(f"{nats}?stream=EFREQ{unique}&storage=memory", unique)
    kafka = request.getfixturevalue("request_kafka_url")
    return Place(f"{kafka}&topic_prefix=r{unique}.", unique)


@pytest.fixture
async def inventory(place: Place) -> AsyncIterator[Participant]:
    """The participant, running in an app of its own all test long."""
    participant = Participant()
    app = place.app("inventory", handlers=participant.handlers(f"inv{place.unique}"))
    async with app:
        yield participant


async def test_a_reply_is_returned_decoded(place: Place, inventory: Participant) -> None:
    async with place.app("orders") as orders:
        reply = await orders.request(
            ReserveStock(order_id="o-1", qty=3), expect=StockReserved, timeout=30.0
        )
    assert reply == StockReserved(order_id="o-1", left=7)
    assert inventory.received == ["o-1"]
    # Two messages of another type on the reply's topics were caused by it and skipped.
    assert orders.stats()["requests"]["replied"] == 1


async def test_a_union_picks_the_type_that_came(place: Place, inventory: Participant) -> None:
    inventory.reject.add("o-2")
    async with place.app("orders") as orders:
        rejected = await orders.request(
            ReserveStock(order_id="o-2"), expect=StockReserved | StockRejected, timeout=30.0
        )
        reserved = await orders.request(
            ReserveStock(order_id="o-3"), expect=StockReserved | StockRejected, timeout=30.0
        )
    assert rejected == StockRejected(order_id="o-2", reason="short")
    assert reserved == StockReserved(order_id="o-3", left=9)


async def test_other_types_caused_by_the_command_are_not_replies(
    place: Place, inventory: Participant, waiter: Wait
) -> None:
    """The participant publishes ``StockChecked`` (on its own topic and on the reply's)
    before it answers: a request expecting ``StockChecked | StockReserved`` returns the
    first, one expecting ``StockReserved`` skips both and returns the reply.

    The commands are keyed by order, so the participant's messages keep the key and the
    reply topic's ``StockChecked`` comes before its ``StockReserved`` on every broker (on
    Kafka, keyless messages of one topic land on any partition, in no order between them:
    "first" would be whichever partition's fetch came back first)."""
    async with place.app("orders") as orders:
        first = await orders.request(
            ReserveStock(order_id="o-4"),
            expect=StockChecked | StockReserved,
            timeout=30.0,
            key="o-4",
        )
        reply = await orders.request(
            ReserveStock(order_id="o-5"), expect=StockReserved, timeout=30.0, key="o-5"
        )
        assert first == StockChecked(order_id="o-4")
        assert reply == StockReserved(order_id="o-5", left=9)
        # o-5's StockChecked on the reserved topic reached the listener and was skipped.
        await waiter(lambda: orders.stats()["requests"]["skipped"] >= 1, timeout=30.0)


async def test_no_reply_in_time_raises_and_the_command_was_sent(
    place: Place, inventory: Participant, waiter: Wait
) -> None:
    inventory.silent.add("o-6")
    async with place.app("orders") as orders:
        with pytest.raises(RequestTimeoutError) as raised:
            await orders.request(ReserveStock(order_id="o-6"), expect=StockReserved, timeout=0.5)
        await waiter(lambda: inventory.received == ["o-6"], timeout=30.0, what="the command")
        assert orders.stats()["requests"]["timed_out"] == 1
    assert isinstance(raised.value, TimeoutError)
    assert raised.value.expected == (StockReserved.event_type,)
    assert "within 0.5s" in str(raised.value)


async def test_a_late_reply_is_dropped_and_counted(
    place: Place, inventory: Participant, waiter: Wait
) -> None:
    held = inventory.hold["o-7"] = asyncio.Event()
    async with place.app("orders") as orders:
        with pytest.raises(RequestTimeoutError):
            await orders.request(ReserveStock(order_id="o-7"), expect=StockReserved, timeout=0.5)
        held.set()  # the participant answers now, after the request gave up
        await waiter(
            lambda: orders.stats()["requests"]["late"] == 1, timeout=30.0, what="a late reply"
        )
        # The app goes on answering requests.
        reply = await orders.request(
            ReserveStock(order_id="o-8"), expect=StockReserved, timeout=30.0
        )
        assert reply.order_id == "o-8"
        stats = orders.stats()["requests"]
    assert (stats["sent"], stats["replied"], stats["timed_out"], stats["late"]) == (2, 1, 1, 1)


async def test_concurrent_requests_get_their_own_replies(
    place: Place, inventory: Participant
) -> None:
    inventory.reject.add("o-11")
    async with place.app("orders") as orders:
        replies = await asyncio.gather(
            *(
                orders.request(
                    ReserveStock(order_id=f"o-{n}"),
                    expect=StockReserved | StockRejected,
                    timeout=30.0,
                    key=f"o-{n}",
                )
                for n in (9, 10, 11)
            )
        )
    assert [r.order_id for r in replies] == ["o-9", "o-10", "o-11"]
    assert [type(r) for r in replies] == [StockReserved, StockReserved, StockRejected]


async def test_two_apps_of_one_name_keep_their_own_replies(
    place: Place, inventory: Participant, waiter: Wait
) -> None:
    """Two instances of ``orders`` (the same name, so the same groups for their handlers)
    asking at once: each gets the reply to its own command, and skips the other's (read
    without being decoded)."""
    async with place.app("orders") as one, place.app("orders") as two:
        a, b = await asyncio.gather(
            one.request(ReserveStock(order_id="o-12"), expect=StockReserved, timeout=30.0),
            two.request(ReserveStock(order_id="o-13"), expect=StockReserved, timeout=30.0),
        )
        assert (a.order_id, b.order_id) == ("o-12", "o-13")
        for app in (one, two):
            await waiter(lambda app=app: app.stats()["requests"]["skipped"] >= 2, timeout=30.0)


async def test_a_stopped_app_leaves_no_reply_group_behind(
    place: Place, inventory: Participant
) -> None:
    """Its reply groups go with it (temporary groups): on the memory broker, one left in the
    hub would fill with replies nobody reads and then hold every publisher of the topic
    back; on NATS, its consumers would stay for good. Kafka keeps the group's committed
    offsets (they hold nothing back) for its offsets retention."""
    orders = place.app("orders")
    async with orders:
        await orders.request(ReserveStock(order_id="o-20"), expect=StockReserved, timeout=30.0)
        group = orders._requests.group
        assert await orders.broker.declare(StockReserved.event_type, group=group, create=False)
    async with place.app("observer") as observer:
        left = await observer.broker.declare(StockReserved.event_type, group=group, create=False)
    assert left is (place.broker.startswith("kafka"))


async def test_replies_after_the_app_stopped_hold_no_publisher_back(
    broker_name: str, hub: MemoryBroker
) -> None:
    """With room for 5 messages per group, 20 replies published after the asking app
    stopped would wait for (and then fail on) its reply group, were it still in the hub."""
    url = f"memory://{broker_name}?max_pending=5&publish_timeout=0.5"
    participant = Participant()
    async with App("inventory", broker=url, handlers=participant.handlers("inv")) as inventory:
        async with App("orders", broker=url) as orders:
            await orders.request(ReserveStock(order_id="o-1"), expect=StockReserved, timeout=30.0)
        for n in range(20):
            await inventory.publish(StockReserved(order_id=f"o-{n}", left=n))


async def test_request_checks_its_arguments(broker_url: str) -> None:
    async with App("orders", broker=broker_url) as orders:
        with pytest.raises(eventflow.ConfigurationError, match="expect= takes an Event"):
            await orders.request(ReserveStock(order_id="o"), expect=dict, timeout=1.0)
        with pytest.raises(eventflow.ConfigurationError, match="timeout="):
            await orders.request(ReserveStock(order_id="o"), expect=StockReserved, timeout=0)
    with pytest.raises(eventflow.BrokerError, match="not running"):
        await orders.request(ReserveStock(order_id="o"), expect=StockReserved, timeout=1.0)


def raw_replier(payload: Callable[[str], bytes]) -> Any:
    """A participant that answers with raw bytes of its own (a foreign producer's)."""

    @subscribe(ReserveStock.event_type, group="raw")
    async def reserve(cmd: ReserveStock, ctx: Context) -> None:
        await ctx.app.broker.publish(StockReserved.event_type, payload(ctx.envelope.id))

    return reserve


async def test_a_foreign_producer_s_reply_is_decoded_to_be_read(broker_url: str) -> None:
    """Bytes not in eventflow's own field order cannot be peeked at: they are decoded."""

    def reordered(cause: str) -> bytes:
        data = {"order_id": "o-f", "left": 1, "causation_id": "decoy"}
        fields = {"data": data, "id": "f-1", "type": StockReserved.event_type}
        return orjson.dumps({**fields, "causation_id": cause})

    inventory = App("inventory", broker=broker_url, handlers=[raw_replier(reordered)])
    async with inventory, App("orders", broker=broker_url) as orders:
        reply = await orders.request(
            ReserveStock(order_id="o-f"), expect=StockReserved, timeout=30.0
        )
    assert reply == StockReserved(order_id="o-f", left=1)


async def test_a_reply_that_does_not_validate_raises_to_the_caller(broker_url: str) -> None:
    def invalid(cause: str) -> bytes:
        data = {"order_id": "o-v"}  # no "left"
        return Envelope.create(StockReserved.event_type, data, causation_id=cause).to_bytes()

    inventory = App("inventory", broker=broker_url, handlers=[raw_replier(invalid)])
    async with inventory, App("orders", broker=broker_url) as orders:
        with pytest.raises(eventflow.EventValidationError, match="left"):
            await orders.request(ReserveStock(order_id="o-v"), expect=StockReserved, timeout=30.0)
        assert orders.health().ok  # the listener goes on


async def test_a_request_waiting_when_the_app_stops_fails(broker_url: str) -> None:
    orders = App("orders", broker=broker_url)
    await orders.start()
    waiting = asyncio.ensure_future(
        orders.request(ReserveStock(order_id="o"), expect=StockReserved, timeout=60.0)
    )
    while orders.stats().get("requests", {}).get("sent") != 1:
        await asyncio.sleep(0.005)
    await orders.stop()
    with pytest.raises(eventflow.BrokerError, match="stopped while request"):
        await waiting


async def test_a_restarted_app_listens_again(broker_url: str, hub: MemoryBroker) -> None:
    participant = Participant()
    async with App("inventory", broker=broker_url, handlers=participant.handlers("inv")):
        orders = App("orders", broker=broker_url)
        for order_id in ("o-1", "o-2"):
            async with orders:
                reply = await orders.request(
                    ReserveStock(order_id=order_id), expect=StockReserved, timeout=30.0
                )
                assert reply.order_id == order_id


def test_the_readme_example_runs_and_prints_what_it_says(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    found = re.search(r"^## Request-reply\n(.*?)^## ", readme, re.M | re.S)
    assert found, "README has no '## Request-reply' section"
    code = re.findall(r"^```python\n(.*?)^```", found.group(1), re.M | re.S)[0]
    printed = re.findall(r"^```text\n(.*?)^```", found.group(1), re.M | re.S)[0]
    script = tmp_path / "request_example.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == printed.strip().splitlines()
