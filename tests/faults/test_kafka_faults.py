"""Kafka fault tests on a real Kafka-protocol broker (Tansu, or ``EVENTFLOW_TEST_KAFKA_URL``).

- a member killed with SIGKILL mid-batch loses nothing: its unfinished messages reach
  another member of the group;
- a graceful leave during a rebalance redelivers nothing;
- a poison message reaches the dead-letter queue after exactly ``max_attempts`` attempts
  while the other messages keep flowing, in one process and across crashing processes;
- the server gone for seconds: a bounded number of log records, and ``close`` still ends
  promptly, leaving no task behind;
- a publish the server may have received says "maybe sent", one it cannot have "not sent".
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError

from eventflow import (
    App,
    BrokerError,
    Context,
    Envelope,
    Event,
    PublishUnconfirmedError,
    RetryPolicy,
    subscribe,
)
from eventflow.adapters.kafka import KafkaBroker
from eventflow.adapters.kafka.logs import CLIENT_LOG_THROTTLE
from eventflow.testing.broker_contract import eventually, unique_name
from eventflow.testing.kafka_server import (
    KafkaServer,
    KafkaServerUnavailable,
    fast_test_url,
    kafka_service_url,
)
from eventflow.testing.services import service_unavailable

from .children import launch

pytestmark = pytest.mark.service("kafka")

MEMBER = Path(__file__).with_name("kafka_member.py")


class FaultJob(Event, type="fault.job", version=1):
    """A unit of work; ``poison`` marks the message that always fails."""

    n: int
    poison: bool = False


@pytest.fixture(scope="module")
def kafka_url() -> Iterator[str]:
    """One Kafka-protocol broker for this module, with test timings in the URL."""
    with kafka_service_url() as url:
        yield fast_test_url(url)


@pytest.fixture
async def publisher(kafka_url: str) -> AsyncIterator[App]:
    """An app that only publishes."""
    async with App("fault-publisher", broker=KafkaBroker.from_url(kafka_url)) as app:
        yield app


class Child:
    """A ``kafka_member.py`` process and the lines it wrote."""

    def __init__(self, proc: asyncio.subprocess.Process, out: Path) -> None:
        self.proc = proc
        self.out = out

    def lines(self) -> list[list[str]]:
        if not self.out.exists():
            return []
        return [line.split() for line in self.out.read_text().splitlines() if line.strip()]

    def ids(self) -> set[str]:
        return {line[0] for line in self.lines()}


async def start_child(url: str, topic: str, group: str, out: Path, *extra: str) -> Child:
    """Start a member process and wait until its subscription is live."""
    return Child(await launch(MEMBER, url, topic, group, str(out), *extra, what="child"), out)


async def stop_child(child: Child) -> None:
    """SIGKILL a child if it is still running and reap it."""
    if child.proc.returncode is None:
        child.proc.send_signal(signal.SIGKILL)
    await child.proc.wait()


async def test_sigkill_mid_batch_loses_nothing(
    kafka_url: str, publisher: App, tmp_path: Path
) -> None:
    """A member killed with SIGKILL while handling a batch loses nothing: every message it
    had not finished is handled by the other member once the group rebalances."""
    topic, group = f"{unique_name()}.kill", unique_name("g")
    victim = await start_child(kafka_url, topic, group, tmp_path / "victim", "--slow", "0.05")
    survivor_ids: set[str] = set()
    survivor_keys: set[str] = set()

    @subscribe(topic, group=group, concurrency=4)
    async def handle(env: Envelope, ctx: Context) -> None:
        survivor_ids.add(env.id)
        survivor_keys.add(env.key or "")

    survivor = App("survivor", broker=KafkaBroker.from_url(kafka_url), handlers=[handle])
    try:
        async with survivor:
            sent = {
                (await publisher.publish(FaultJob(n=i), key=f"k{i % 16}", topic=topic)).id
                for i in range(300)
            }
            # Kill the victim in the middle of its share: some handled, most not yet.
            await eventually(lambda: len(victim.ids()) >= 20, timeout=30, message="victim busy")
            victim.proc.send_signal(signal.SIGKILL)
            await victim.proc.wait()
            handled_by_victim = victim.ids()
            victim_keys = {line[2] for line in victim.lines()}
            assert len(handled_by_victim) < 150, "the victim was not killed mid-batch"
            await eventually(
                lambda: sent <= survivor_ids | handled_by_victim,
                timeout=60,
                message="every message handled by one of the members",
            )
    finally:
        await stop_child(victim)
    assert sent - (survivor_ids | handled_by_victim) == set()
    # The victim's partitions (its keys) moved to the survivor, which finished them.
    assert victim_keys & survivor_keys, "the survivor never took over the victim's keys"


async def test_graceful_leave_during_rebalance_redelivers_nothing(
    kafka_url: str, publisher: App
) -> None:
    """Members join and leave gracefully while messages flow: each message is handled once,
    at its first attempt (no redelivery), by one member."""
    topic, group = f"{unique_name()}.leave", unique_name("g")
    handled: list[tuple[str, str, int]] = []

    def member(name: str) -> App:
        @subscribe(topic, group=group, concurrency=8)
        async def handle(env: Envelope, ctx: Context) -> None:
            await asyncio.sleep(0.002)  # a little work, so a rebalance finds messages in flight
            handled.append((name, env.id, ctx.attempt))

        return App(name, broker=KafkaBroker.from_url(kafka_url), handlers=[handle])

    sent: list[str] = []
    first, second, third = member("first"), member("second"), member("third")
    await first.__aenter__()
    try:

        async def produce() -> None:
            for i in range(1000):
                env = await publisher.publish(FaultJob(n=i), key=f"k{i % 32}", topic=topic)
                sent.append(env.id)
                await asyncio.sleep(0.005)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(produce())
            await eventually(lambda: len(handled) >= 50, timeout=30, message="first busy")
            join = tg.create_task(second.__aenter__())  # the group starts rebalancing ...
            await asyncio.sleep(0.3)
            await first.__aexit__(None, None, None)  # ... and `first` leaves during it
            await join
            await eventually(lambda: len(handled) >= 400, timeout=30, message="second busy")
            await third.__aenter__()  # one more rebalance with messages in flight
        await eventually(
            lambda: len(handled) >= len(sent), timeout=60, message="everything handled"
        )
        # Then a marker per key: handled after every earlier message of its key (one
        # partition, in order), so a redelivery of any of them would have come before it.
        markers = {
            (await publisher.publish(FaultJob(n=-1), key=f"k{k}", topic=topic)).id
            for k in range(32)
        }
        sent.extend(markers)
        await eventually(
            lambda: markers <= {env_id for _, env_id, _ in handled},
            timeout=60,
            message="a marker after everything, on every key",
        )
    finally:
        for app in (first, second, third):
            await app.__aexit__(None, None, None)
    counts = Counter(env_id for _, env_id, _ in handled)
    assert set(counts) == set(sent)
    assert [i for i, c in counts.items() if c > 1] == [], "a message was handled twice"
    assert {attempt for _, _, attempt in handled} == {1}
    by_member = Counter(name for name, _, _ in handled)
    assert by_member["first"] and by_member["second"] and by_member["third"], by_member


async def test_poison_message_is_dead_lettered_after_max_attempts(
    kafka_url: str, publisher: App
) -> None:
    """A message that always fails is tried exactly ``max_attempts`` times, then dead-lettered
    with its raw bytes, error, attempts and Kafka position, while the rest keep flowing."""
    topic, group = f"{unique_name()}.poison", unique_name("g")
    attempts: list[float] = []
    done: list[float] = []

    @subscribe(
        topic,
        group=group,
        concurrency=4,
        retry=RetryPolicy(max_attempts=4, initial_delay=0.2, max_delay=0.4),
    )
    async def handle(job: Event, ctx: Context) -> None:
        # Typed Event, not FaultJob: jobs go to a topic of this test's own (topic=), which a
        # FaultJob handler's pattern could not match, so the app would refuse it.
        assert isinstance(job, FaultJob)
        if job.poison:
            attempts.append(time.monotonic())
            raise ValueError(f"cannot handle job {job.n}")
        done.append(time.monotonic())

    app = App("poison", broker=KafkaBroker.from_url(kafka_url), handlers=[handle])
    async with app:
        poison = await publisher.publish(FaultJob(n=0, poison=True), key="bad", topic=topic)
        for i in range(1, 100):
            await publisher.publish(FaultJob(n=i), key=f"k{i % 10}", topic=topic)
        await eventually(lambda: len(done) == 99, timeout=60, message="others handled")

        async def dead() -> bool:
            return bool(await app.dead_letters.list())

        await eventually(dead, timeout=30, message="poison dead-lettered")
        # A message of the poison's key comes after it (one partition, in order): once it is
        # handled, the poison's attempts are over, and a further one would have come first.
        await publisher.publish(FaultJob(n=100), key="bad", topic=topic)
        await eventually(lambda: len(done) == 100, timeout=60, message="the key's next message")
        [letter] = await app.dead_letters.list()
    assert len(attempts) == 4
    assert letter.attempts == 4
    assert letter.envelope_id == poison.id
    assert letter.payload == poison.to_bytes()
    assert "ValueError: cannot handle job 0" in letter.error
    assert letter.source["topic"] == topic
    assert isinstance(letter.source["partition"], int)
    assert isinstance(letter.source["offset"], int)
    # The rest kept flowing while the poison message was being retried.
    assert sum(attempts[0] < t < attempts[-1] for t in done) > 0


async def test_poison_that_kills_its_process_is_dead_lettered_as_a_crash_loop(
    kafka_url: str, publisher: App, tmp_path: Path
) -> None:
    """A message that crashes every process handling it is counted across members (the
    companion group carries delivery counts, the store the handler starts) and
    dead-lettered as a crash loop after ``max_deliveries``."""
    topic, group = f"{unique_name()}.crash", unique_name("g")
    store = f"sqlite:///{tmp_path / 'dlq.db'}"
    out = tmp_path / "attempts"
    args = ("--crash-on-poison", "--slow", "0.4", "--max-deliveries", "3", "--store", store)
    children: list[Child] = []
    try:
        children.append(await start_child(kafka_url, topic, group, out, *args))
        poison = await publisher.publish(FaultJob(n=0, poison=True), key="bad", topic=topic)
        await publisher.publish(FaultJob(n=1), key="bad", topic=topic)
        for _ in range(3):  # each run handles the poison once and dies
            await asyncio.wait_for(children[-1].proc.wait(), 60)
            assert children[-1].proc.returncode == 17
            children.append(await start_child(kafka_url, topic, group, out, *args))
        # The fourth run finds 3 unfinished starts: dead-letters it, handles the next one.
        await eventually(
            lambda: any(line[0] != poison.id for line in children[-1].lines()),
            timeout=60,
            message="the message after the poison handled",
        )
    finally:
        for child in children:
            if child.proc.returncode is None:
                child.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(child.proc.wait(), 30)
    poison_runs = [line for line in children[-1].lines() if line[0] == poison.id]
    assert len(poison_runs) == 3, poison_runs
    async with App("dlq-reader", store=store) as reader:
        [letter] = await reader.dead_letters.list()
    assert letter.envelope_id == poison.id
    assert letter.reason == "crash-loop"
    assert letter.attempts == 3
    assert letter.source["topic"] == topic


async def test_a_dead_server_logs_a_bounded_number_of_records_and_close_still_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With the server gone, aiokafka retries (and used to log an error) dozens of times a
    second; each recurring record is let through once. ``close`` then ends within about
    ``session_timeout`` (aiokafka would retry the final commit for ever), without raising
    and without leaving a client task running."""
    try:
        server = KafkaServer()
    except KafkaServerUnavailable as exc:
        service_unavailable(str(exc))
    before = asyncio.all_tasks()
    with server:
        broker = KafkaBroker.from_url(fast_test_url(server.url))
        await broker.start()
        try:
            topic = f"{unique_name()}.gone"
            sub = await broker.subscribe(topic, group=unique_name("g"))
            await broker.publish(topic, b"m", key="k")
            [d] = await sub.fetch(1, 15)
            await d.ack()
            caplog.set_level(logging.WARNING)
            caplog.clear()
            CLIENT_LOG_THROTTLE.reset()  # what earlier tests logged does not count here
            await asyncio.to_thread(server.stop)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 3.0
            while loop.time() < deadline:
                await sub.fetch(10, 0.5)
            records = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert any(r.name.startswith("aiokafka") for r in records), "the outage shows"
            assert len(records) <= 15, [f"{r.name}: {r.getMessage()}" for r in records]
        finally:
            began = asyncio.get_running_loop().time()
            await asyncio.wait_for(broker.close(), 30)
            took = asyncio.get_running_loop().time() - began
    assert took < 10, f"close took {took:.1f}s"
    await asyncio.sleep(0.1)
    left = {t for t in asyncio.all_tasks() - before if not t.done()}
    left.discard(asyncio.current_task())  # type: ignore[arg-type]
    assert not left, left


async def test_a_publish_the_brokers_did_not_confirm_says_maybe_sent() -> None:
    """The server goes away: a record already in the producer's hands fails after
    ``publish_timeout`` with ``PublishUnconfirmedError`` ("maybe sent": the producer may have
    sent it, and retries on its own), not a plain ``BrokerError`` read as "not sent"; a
    record for a topic whose partitions it cannot even look up was not sent, and says so."""
    try:
        server = KafkaServer()
    except KafkaServerUnavailable as exc:
        service_unavailable(str(exc))
    with server:
        url = fast_test_url(server.url).replace("publish_timeout=10", "publish_timeout=1")
        broker = KafkaBroker.from_url(f"{url}&create_topics=false")
        await broker.start()
        try:
            topic = f"{unique_name()}.unconfirmed"
            await broker.ensure_topics([topic])
            await broker.publish(topic, b"stored", key="k")
            assert broker.problems() == ()
            await asyncio.to_thread(server.stop)
            with pytest.raises(PublishUnconfirmedError) as info:
                await broker.publish(topic, b"in doubt", key="k")
            text = str(info.value)
            assert "maybe sent" in text and "envelope id" in text
            assert isinstance(info.value.__cause__, KafkaError)
            # what the app's health (eventflow status) reports, until a publish succeeds
            (problem,) = broker.problems()
            assert problem.startswith(f"broker: publishes to {broker.url} fail since 20")
            with pytest.raises(BrokerError) as unsent:
                await broker.publish(f"{unique_name()}.unknown", b"nowhere", key="k")
            assert not isinstance(unsent.value, PublishUnconfirmedError)
            assert "not sent" in str(unsent.value)
        finally:
            await asyncio.wait_for(broker.close(), 30)
