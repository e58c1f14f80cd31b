"""Consumer lag on ``/metrics``, on NATS and Kafka servers the tests start: in messages it
is what the broker itself reports (NATS: each partition consumer's ``num_pending`` plus
``num_ack_pending``; Kafka: end offsets minus the group's committed offsets), in seconds it
grows while the consumer holds its oldest message and is zero once it caught up, for the
group and for each partition."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable, Iterator

import httpx
import nats
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from eventflow import App, Event, subscribe
from eventflow.adapters.kafka import KafkaBroker
from eventflow.adapters.kafka.config import kafka_topic
from eventflow.adapters.nats import NatsBroker
from eventflow.adapters.nats.config import consumer_name, group_id
from eventflow.testing.kafka_server import fast_test_url, kafka_service_url
from eventflow.testing.nats_server import nats_service_url

Wait = Callable[..., Awaitable[None]]
_runs = itertools.count()
HELD = 10  # messages published while the handler holds the first


class Job(Event, type="it.mlag.job"):
    n: int


@pytest.fixture(scope="module", params=["nats", "kafka"])
def network_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A NATS or a Kafka-protocol server for this module."""
    if request.param == "nats":
        with nats_service_url() as url:
            yield url
    else:
        with kafka_service_url() as url:
            yield fast_test_url(url)


async def _native_lag(app: App, topic: str, group: str) -> int:
    """What the broker itself says the group has not handled on ``topic``."""
    return sum((await _native_partitions(app, topic, group)).values())


async def _native_partitions(app: App, topic: str, group: str) -> dict[str, int]:
    """The same per partition, named as the ``partition`` label names them."""
    broker = app.broker
    if isinstance(broker, NatsBroker):
        cfg = broker.config
        client = await nats.connect(broker.url.split("?", 1)[0])
        try:
            js = client.jetstream()
            found: dict[str, int] = {}
            for partition in range(cfg.partitions):
                name = consumer_name(group_id(group, topic), partition)
                try:
                    info = await js.consumer_info(cfg.stream, name)
                except NotFoundError:
                    continue
                pending = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
                found[str(partition)] = pending
            return found
        finally:
            await client.close()
    assert isinstance(broker, KafkaBroker)
    bootstrap = broker.config.bootstrap_servers
    name = kafka_topic(topic, broker.config.topic_prefix)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await admin.start()
    await reader.start()
    try:
        parts = reader.partitions_for_topic(name) or set()
        if not parts:
            await reader.force_metadata_update()
            parts = reader.partitions_for_topic(name) or set()
        tps = [TopicPartition(name, p) for p in sorted(parts)]
        ends = await reader.end_offsets(tps)
        committed = await admin.list_consumer_group_offsets(group, partitions=tps)
        firsts = await reader.beginning_offsets(tps)
        found = {}
        for tp in tps:
            done = committed[tp].offset if tp in committed else -1
            found[f"{name}/{tp.partition}"] = ends[tp] - (done if done >= 0 else firsts[tp])
        return found
    finally:
        await reader.stop()
        await admin.close()


async def _lag(app: App, group: str, topic: str) -> tuple[float, float]:
    """(messages, seconds) as ``/metrics`` says, scraped over HTTP."""
    found, _, _ = await _scrape_lag(app, group, topic)
    return found["eventflow_consumer_lag_messages"], found["eventflow_consumer_lag_seconds"]


async def _scrape_lag(
    app: App, group: str, topic: str
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The group's lag samples by name, and its lag in messages and in seconds per
    partition label."""
    assert app.metrics is not None and app.http_address is not None
    app.metrics.sampler.min_interval = 0.0  # read afresh on each scrape
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{app.http_address[1]}/metrics")
    assert response.status_code == 200, response.text
    found: dict[str, float] = {}
    partitions: dict[str, float] = {}
    ages: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            if s.labels.get("group") != group or s.labels.get("topic") != topic:
                continue
            if s.name == "eventflow_consumer_partition_lag_messages":
                partitions[s.labels["partition"]] = s.value
            elif s.name == "eventflow_consumer_partition_lag_seconds":
                ages[s.labels["partition"]] = s.value
            else:
                found[s.name] = s.value
    return found, partitions, ages


async def test_lag_matches_the_broker_grows_while_held_and_falls_after(
    network_url: str, waiter: Wait
) -> None:
    run = f"{os.getpid()}-{next(_runs)}"
    topic, group = f"it.mlag.job.r{run.replace('-', '_')}", f"mlag-{run}"
    release = asyncio.Event()
    handled: list[int] = []

    @subscribe(topic, group=group, concurrency=1, any_topic=True)
    async def handle(event: Job) -> None:
        await release.wait()
        handled.append(event.n)

    app = App(
        f"it-mlag-{run}",
        broker=network_url,
        handlers=[handle],
        http_port=0,
        http_host="127.0.0.1",
    )
    async with app:
        # The series exist from the start of the subscription, at zero.
        assert await _lag(app, group, topic) == (0.0, 0.0)
        for n in range(HELD):
            await app.publish(Job(n=n), key="one-key", topic=topic)

        async def all_counted() -> bool:
            return await _native_lag(app, topic, group) == HELD

        await waiter(all_counted, timeout=30, what="the broker counting every message")
        messages, first_age = await _lag(app, group, topic)
        assert messages == HELD == await _native_lag(app, topic, group)  # the handler holds
        # Per partition too: every partition the group reads, one key's all in one.
        native = await _native_partitions(app, topic, group)
        _, partitions, ages = await _scrape_lag(app, group, topic)
        assert partitions == {p: float(n) for p, n in native.items()}
        assert sorted(partitions.values())[-1] == HELD
        # In seconds per partition: the held key's partition is as old as the group's
        # oldest, the others (nothing pending) are 0.
        [busy] = [p for p, n in partitions.items() if n == HELD]
        assert ages.keys() == partitions.keys()
        assert ages[busy] > 0 and all(a == 0 for p, a in ages.items() if p != busy)
        first_partition_age = ages[busy]

        async def older() -> bool:
            found, _, ages = await _scrape_lag(app, group, topic)
            return (
                found["eventflow_consumer_lag_seconds"] >= first_age + 1.0
                and ages[busy] >= first_partition_age + 1.0
            )

        await waiter(older, timeout=30, what="lag in seconds growing while held")
        release.set()
        await waiter(lambda: len(handled) == HELD, timeout=30, what="every message handled")

        async def caught_up() -> bool:
            return await _native_lag(app, topic, group) == 0

        await waiter(caught_up, timeout=30, what="the broker counting nothing left")
        assert await _lag(app, group, topic) == (0.0, 0.0)
        _, partitions, ages = await _scrape_lag(app, group, topic)
        assert set(partitions.values()) == {0.0} and set(ages.values()) == {0.0}
