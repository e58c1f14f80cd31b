"""Fault tests of the NATS JetStream adapter against a real nats-server (file store).

- a member killed with SIGKILL mid-batch: its unacked messages reach another member;
- a graceful leave of an app: nothing is handled twice, no attempt is counted twice;
- the server killed and restarted mid-stream: no acked publish is lost;
- a poison message: dead-lettered after exactly ``max_attempts`` attempts, the rest flow;
- a server down for seconds: a bounded number of warnings, not one per reconnect attempt;
- closing while the server is down: prompt, and no task of the client is left;
- a publish during an outage: "maybe sent" (and then delivered), not "not sent"; a publish
  nothing can store: "not sent".

The server is started here (it is restarted by one test), from the bundled binary; without
one the module skips, or fails under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from eventflow import App, BrokerError, Context, Event, PublishUnconfirmedError, subscribe
from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig
from eventflow.ports import Delivery
from eventflow.testing.broker_contract import collect, drain, eventually, unique_name
from eventflow.testing.nats_server import NatsServer, NatsServerUnavailable
from eventflow.testing.services import service_unavailable

pytestmark = pytest.mark.service("nats")

MEMBER = Path(__file__).with_name("nats_member.py")
FAST = "ack_wait=2&heartbeat_interval=0.25&partitions=4"


def _server() -> NatsServer:
    try:
        return NatsServer()
    except NatsServerUnavailable as exc:
        service_unavailable(str(exc))


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A file-stored JetStream server shared by the tests that do not restart it."""
    with _server() as server:
        yield server.url


@pytest.fixture
def stream() -> str:
    """A fresh stream name: each test has its own stream, buckets and consumers."""
    return unique_name("EF").upper()


@pytest.fixture
async def brokers(nats_url: str, stream: str) -> AsyncIterator[list[NatsBroker]]:
    """Brokers opened by the test; closed at the end."""
    opened: list[NatsBroker] = []
    yield opened
    for broker in opened:
        await broker.close()


async def _broker(url: str, stream: str, opened: list[NatsBroker], extra: str = "") -> NatsBroker:
    broker = NatsBroker(NatsBrokerConfig.from_url(f"{url}?stream={stream}&{FAST}{extra}"))
    await broker.start()
    opened.append(broker)
    return broker


def _lines(path: Path, prefix: str) -> list[str]:
    if not path.exists():
        return []
    return [ln[len(prefix) :] for ln in path.read_text().splitlines() if ln.startswith(prefix)]


async def test_member_killed_mid_batch_loses_nothing(
    nats_url: str, stream: str, brokers: list[NatsBroker]
) -> None:
    """SIGKILL a member holding unacked messages: another member gets every one of them."""
    publisher = await _broker(nats_url, stream, brokers)
    topic, group = f"{unique_name()}.jobs", unique_name("g")
    log = Path(tempfile.mkdtemp()) / "member.log"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(MEMBER),
        nats_url,
        stream,
        topic,
        group,
        str(log),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await eventually(lambda: "ready" in _lines(log, ""), timeout=30, message="child ready")
        total = 40
        wanted = [f"m{i}" for i in range(total)]
        for i, text in enumerate(wanted):
            await publisher.publish(topic, text.encode(), key=f"k{i % 8}")
        await eventually(lambda: len(_lines(log, "got ")) >= 10, message="child mid-batch")
    finally:
        child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(child.wait(), timeout=10)
    acked_by_child = set(_lines(log, "acked "))
    maybe_acked = set(_lines(log, "acking ")) - acked_by_child  # killed between the two lines
    held_by_child = set(_lines(log, "got ")) - acked_by_child - maybe_acked
    assert held_by_child, "the child died holding unacked messages"

    survivor = await (await _broker(nats_url, stream, brokers)).subscribe(topic, group=group)
    got: list[Delivery] = []
    must = set(wanted) - acked_by_child - maybe_acked

    async def all_arrived() -> bool:
        got.extend(await collect(survivor, 1, timeout=30))
        return must <= {d.payload.decode() for d in got}

    await eventually(all_arrived, timeout=30, message="the survivor got every unacked message")
    got.extend(await drain(survivor, 1.0))
    texts = [d.payload.decode() for d in got]
    assert set(texts) | acked_by_child | maybe_acked == set(wanted)
    assert not set(texts) & acked_by_child, "acked messages are not redelivered"
    assert held_by_child <= set(texts), "every message the child held reached the survivor"
    redelivered = [d for d in got if d.payload.decode() in held_by_child]
    assert all(d.delivery_count >= 2 for d in redelivered)


class Step(Event, type="faults.nats.step"):
    """A unit of work with a key and a sequence number."""

    key: str
    n: int


async def test_graceful_leave_causes_no_redelivery(nats_url: str, stream: str) -> None:
    """An app leaving mid-stream finishes or releases its messages: the other app handles
    every remaining one, each exactly once and on its first attempt."""
    handled: Counter[str] = Counter()
    attempts: list[int] = []
    order: dict[str, list[int]] = defaultdict(list)

    def make_app(name: str) -> App:
        @subscribe("faults.nats.step", group="steps", concurrency=4)
        async def on_step(event: Step, ctx: Context) -> None:
            await asyncio.sleep(0.002)
            handled[ctx.envelope.id] += 1
            attempts.append(ctx.attempt)
            order[event.key].append(event.n)

        broker = NatsBroker(NatsBrokerConfig.from_url(f"{nats_url}?stream={stream}&{FAST}"))
        return App(name, broker=broker, handlers=[on_step], grace_period=5.0)

    leaving, staying = make_app("leaving"), make_app("staying")
    total = 300
    async with staying:
        async with leaving:
            for n in range(total):
                await leaving.publish(Step(key=f"k{n % 10}", n=n), key=f"k{n % 10}")
            await eventually(lambda: sum(handled.values()) >= 30, message="work started")
        # `leaving` stopped mid-stream; `staying` picks up what it had not finished
        await eventually(lambda: sum(handled.values()) >= total, timeout=60, message="all handled")
        # No redelivery can come once the server has no message out unacked nor any left
        # to deliver, on every consumer of the stream.
        await eventually(
            lambda: _nothing_outstanding(nats_url, stream),
            timeout=30,
            message="no message unacked or undelivered on the server",
        )
    assert len(handled) == total
    assert set(handled.values()) == {1}, "no message handled twice"
    assert set(attempts) == {1}, "a released delivery is not counted as an attempt"
    bad = {k: ns for k, ns in order.items() if ns != sorted(ns)}
    assert not bad, f"per-key order across the leave: {bad}"


async def _nothing_outstanding(nats_url: str, stream: str) -> bool:
    """True if no consumer of ``stream`` has a message delivered but unacked, or pending."""
    nc = await nats.connect(nats_url)
    try:
        infos = await nc.jetstream().consumers_info(stream)
    finally:
        await nc.close()
    assert infos, f"no consumer on {stream}"
    return all(not info.num_ack_pending and not info.num_pending for info in infos)


async def test_server_killed_and_restarted_loses_no_acked_publish() -> None:
    """Kill -9 the server mid-stream and restart it on its store dir: every publish that
    returned is consumed, and publishing and consuming resume by themselves."""
    with _server() as server:
        stream = unique_name("EF").upper()
        url = f"{server.url}?stream={stream}&{FAST}&publish_timeout=30"
        publisher = NatsBroker(NatsBrokerConfig.from_url(url))
        consumer = NatsBroker(NatsBrokerConfig.from_url(url))
        await publisher.start()
        await consumer.start()
        try:
            topic = f"{unique_name()}.orders"
            sub = await consumer.subscribe(topic, group=unique_name("g"))
            received: set[str] = set()

            async def consume() -> None:
                while True:
                    batch: list[Delivery] = list(await sub.fetch(50, 0.5))
                    for d in batch:
                        received.add(d.payload.decode())
                        await d.ack()

            acked: list[str] = []
            total = 400
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(consume())
                for i in range(total):
                    if i == total // 2:
                        await asyncio.to_thread(server.restart, crash=True)
                    text = f"m{i}"
                    await publisher.publish(topic, text.encode(), key=f"k{i % 16}")
                    acked.append(text)
                try:
                    await eventually(
                        lambda: received >= set(acked), timeout=60, message="acked consumed"
                    )
                finally:
                    task.cancel()
            assert len(acked) == total
            assert received == set(acked)
        finally:
            await consumer.close()
            await publisher.close()


class Charge(Event, type="faults.nats.charge"):
    """A payment; ``poison`` makes the handler fail every time."""

    n: int
    poison: bool = False


async def test_poison_message_reaches_dlq_after_max_attempts(nats_url: str, stream: str) -> None:
    """A message whose handler always fails is dead-lettered after exactly ``retry`` attempts,
    with its raw bytes, error, attempts and stream sequence, while the rest keep flowing."""
    calls: Counter[int] = Counter()
    done: set[int] = set()

    @subscribe("faults.nats.charge", group="billing", retry=3)
    async def charge(event: Charge, ctx: Context) -> None:
        calls[event.n] += 1
        if event.poison:
            raise RuntimeError(f"card {event.n} declined")
        done.add(event.n)

    broker = NatsBroker(NatsBrokerConfig.from_url(f"{nats_url}?stream={stream}&{FAST}"))
    app = App("billing", broker=broker, handlers=[charge])
    total, poison = 40, 7
    async with app:
        envelopes = [
            await app.publish(Charge(n=n, poison=n == poison), key="same-customer")
            for n in range(total)
        ]
        await eventually(lambda: len(done) == total - 1, timeout=30, message="others handled")

        async def one_letter() -> bool:
            return len(await app.dead_letters.list()) == 1

        await eventually(one_letter, message="the poison message dead-lettered")
        [letter] = await app.dead_letters.list()
    assert calls[poison] == 3
    assert all(calls[n] == 1 for n in range(total) if n != poison)
    assert letter.attempts == 3
    assert "card 7 declined" in letter.error
    assert letter.payload == envelopes[poison].to_bytes()
    assert letter.envelope_id == envelopes[poison].id
    assert letter.source["stream"] == stream
    assert isinstance(letter.source["stream_seq"], int) and letter.source["stream_seq"] > 0


async def test_a_dead_server_logs_a_bounded_number_of_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the server is down the client retries four times a second and the group's
    coordinator every tick; each condition is logged once (then at most every 30 s), and
    everything works again once the server is back."""
    with _server() as server:
        stream = unique_name("EF").upper()
        broker = NatsBroker(NatsBrokerConfig.from_url(f"{server.url}?stream={stream}&{FAST}"))
        await broker.start()
        try:
            topic = f"{unique_name()}.quiet"
            sub = await broker.subscribe(topic, group=unique_name("g"))
            caplog.set_level(logging.WARNING, logger="eventflow.nats")
            caplog.clear()
            await asyncio.to_thread(server.kill)
            await asyncio.sleep(3.0)  # 12 reconnect attempts and 12 coordinator ticks
            warnings = [
                r.getMessage()
                for r in caplog.records
                if r.name == "eventflow.nats" and r.levelno >= logging.WARNING
            ]
            assert any("disconnected" in w for w in warnings), warnings  # it is reported
            assert len(warnings) <= 4, warnings
            await asyncio.to_thread(server.start)
            await broker.publish(topic, b"back", key="k")
            assert [d.payload for d in await collect(sub, 1, timeout=30)] == [b"back"]
        finally:
            await broker.close()


async def test_closing_while_the_server_is_down_is_prompt_and_leaves_no_task() -> None:
    """SIGTERM during an outage: ``close`` does not wait out request timeouts for round
    trips that cannot succeed (``ack_wait`` and ``lease_ttl`` bring messages and partitions
    back), and no task of the client or the group is left running."""
    before = asyncio.all_tasks()
    with _server() as server:
        stream = unique_name("EF").upper()
        broker = NatsBroker(NatsBrokerConfig.from_url(f"{server.url}?stream={stream}&{FAST}"))
        await broker.start()
        topic = f"{unique_name()}.down"
        sub = await broker.subscribe(topic, group=unique_name("g"))
        await broker.publish(topic, b"held", key="k")
        [held] = await collect(sub, 1, ack=False)
        await asyncio.to_thread(server.kill)
        await eventually(lambda: not broker._connection().is_connected, message="disconnected")
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(broker.close(), 30)
        took = loop.time() - began
    assert took < 1.0, f"close took {took:.1f}s"
    await asyncio.sleep(0.1)
    left = {t for t in asyncio.all_tasks() - before if not t.done()}
    left.discard(asyncio.current_task())  # type: ignore[arg-type]
    assert not left, left
    assert held.payload == b"held"


class Outage(Event, type="faults.nats.outage"):
    """A message published while the server is away."""

    n: int


async def test_a_publish_during_an_outage_says_maybe_sent_and_is_delivered() -> None:
    """The server is killed: ``app.publish`` gives up after ``publish_timeout`` with
    ``PublishUnconfirmedError`` saying "maybe sent" (the client buffered the request and
    sends it once it reconnects), and indeed the message is handled after the restart. It
    used to say "not confirmed ... it is safe to retry" as a plain ``BrokerError``, read as
    "not sent"."""
    handled: list[int] = []

    @subscribe("faults.nats.outage", group="outage")
    async def on_outage(event: Outage, ctx: Context) -> None:
        handled.append(event.n)

    with _server() as server:
        stream = unique_name("EF").upper()
        url = f"{server.url}?stream={stream}&{FAST}&publish_timeout=1"
        app = App("outage", broker=url, handlers=[on_outage])
        async with app:
            await asyncio.to_thread(server.kill)
            broker = app.broker
            assert isinstance(broker, NatsBroker)
            await eventually(lambda: not broker._connection().is_connected, message="down")
            with pytest.raises(PublishUnconfirmedError) as info:
                await app.publish(Outage(n=1), key="k")
            text = str(info.value)
            assert "maybe sent" in text and "envelope" in text and "duplicate window" in text
            await asyncio.to_thread(server.start)
            await eventually(lambda: handled == [1], timeout=30, message="handled after it")


async def test_a_publish_no_stream_stores_says_not_sent(nats_url: str, stream: str) -> None:
    """The stream is deleted under a running broker: JetStream answers that nobody stores
    the subject, so the error is a plain ``BrokerError`` saying "not sent" (nothing was
    stored), not ``PublishUnconfirmedError``."""
    broker = NatsBroker(
        NatsBrokerConfig.from_url(f"{nats_url}?stream={stream}&{FAST}&publish_timeout=0.5")
    )
    await broker.start()
    try:
        nc = await nats.connect(nats_url)
        try:
            await nc.jetstream().delete_stream(stream)
        finally:
            await nc.close()
        with pytest.raises(BrokerError) as info:
            await broker.publish(f"{unique_name()}.gone", b"x", key="k")
        assert not isinstance(info.value, PublishUnconfirmedError)
        assert "not sent" in str(info.value)
    finally:
        await broker.close()
