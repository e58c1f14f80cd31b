"""Failover after a SIGKILL with each broker's default settings (DESIGN 3, "Membership").

A member of a group (``holding_member.py``, its own process) holds messages of several keys
(entered its handler, or fetched and waiting behind one, none acked) and is killed with
SIGKILL; the other member, which joined the group before the kill, handles every one of them
within 10 s of the kill, and each key in publish order, including messages of the killed
member's keys published after the kill. The apps use the adapters' defaults (only the NATS
stream name is chosen per test), not the short timings of the other fault tests.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventflow import App, Context, Envelope, Event, subscribe
from eventflow.testing.broker_contract import eventually, unique_name
from eventflow.testing.kafka_server import kafka_service_url
from eventflow.testing.nats_server import NatsServer, NatsServerUnavailable
from eventflow.testing.services import service_unavailable

from .children import spawn, until_ready

MEMBER = Path(__file__).with_name("holding_member.py")
FAILOVER = 10.0  # DESIGN 3: another member handles a dead member's messages within 10 s
KEYS = [f"k{i}" for i in range(16)]
BEFORE, AFTER = 3, 2  # messages per key published before the kill, then after it


class Job(Event, type="faults.failover.job"):
    """The ``n``-th message of its key."""

    n: int


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A file-stored JetStream server for this module."""
    try:
        server = NatsServer()
    except NatsServerUnavailable as exc:
        service_unavailable(str(exc))
    with server:
        yield server.url


@pytest.fixture(scope="module")
def kafka_url() -> Iterator[str]:
    """A Kafka-protocol broker (Tansu, or ``EVENTFLOW_TEST_KAFKA_URL``), default settings."""
    with kafka_service_url() as url:
        yield url


async def _failover(url: str, out: Path) -> str:
    """Run the scenario of the module docstring on ``url``; returns the group's name."""
    topic, group = f"{unique_name()}.jobs", unique_name("g")
    loop = asyncio.get_running_loop()
    handled: dict[str, list[int]] = defaultdict(list)
    last_at = 0.0

    @subscribe(topic, group=group, concurrency=4)
    async def handle(env: Envelope, ctx: Context) -> None:
        nonlocal last_at
        assert isinstance(env.data, dict) and env.key is not None
        handled[env.key].append(env.data["n"])
        last_at = loop.time()

    def held() -> list[tuple[str, int]]:
        if not out.exists():
            return []
        return [(k, int(n)) for k, n in (ln.split() for ln in out.read_text().splitlines())]

    # Both members join at once (on Tansu each join takes half a session timeout).
    victim = await spawn(MEMBER, url, topic, group, str(out))
    try:
        async with App("survivor", broker=url, handlers=[handle]) as survivor:
            await until_ready(victim, "the member")
            for n in range(BEFORE):
                for key in KEYS:
                    await survivor.publish(Job(n=n), key=key, topic=topic)
            # The victim is stuck on the first message of several keys (and holds the rest
            # of its share behind them); the survivor works through its own share.
            await eventually(
                lambda: len({k for k, _ in held()}) >= 2 and handled,
                timeout=20,
                message="both members busy",
            )
            victim.send_signal(signal.SIGKILL)
            await victim.wait()
            killed_at = loop.time()
            victim_keys = {k for k, _ in held()}
            assert not victim_keys & set(handled), "the two members shared a key"
            for n in range(BEFORE, BEFORE + AFTER):
                for key in KEYS:
                    await survivor.publish(Job(n=n), key=key, topic=topic)
            everything = list(range(BEFORE + AFTER))
            await eventually(
                lambda: all(set(handled[key]) >= set(everything) for key in KEYS),
                timeout=FAILOVER + 3,
                message=f"every message handled within {FAILOVER + 3}s of the kill",
            )
    finally:
        if victim.returncode is None:
            victim.send_signal(signal.SIGKILL)
        await victim.wait()
    took = last_at - killed_at
    assert took <= FAILOVER, f"the killed member's messages were handled {took:.1f}s after"
    disorder = {key: ns for key, ns in handled.items() if ns != everything}
    assert not disorder, f"per key, each message once in publish order: {disorder}"
    return group


@pytest.mark.service("nats")
async def test_nats_a_killed_members_messages_move_within_10s_in_key_order(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NATS, default ``ack_wait`` and lease TTL: the dead member's partitions and unacked
    messages reach the other member within 10 s, each key in order; meanwhile the other
    member says once what it waits for and for how long."""
    caplog.set_level(logging.INFO, logger="eventflow.nats")
    group = await _failover(f"{nats_url}?stream={unique_name('EF').upper()}", tmp_path / "held")
    told = [r.getMessage() for r in caplog.records if f"group {group} " in r.getMessage()]
    waits = [m for m in told if "stopped refreshing its leases" in m]
    assert len(waits) == 1, told
    assert re.search(r"they move to this member in about \d+\.\ds", waits[0]), waits
    assert any("took over partitions" in m for m in told), told


@pytest.mark.service("kafka")
async def test_kafka_a_killed_members_messages_move_within_10s_in_key_order(
    kafka_url: str, tmp_path: Path
) -> None:
    """Kafka, default session timeout and heartbeats: the dead member's partitions move and
    its uncommitted messages are handled within 10 s, each key in order."""
    await _failover(kafka_url, tmp_path / "held")
