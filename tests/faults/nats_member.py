"""A group member in its own process, for the NATS fault tests (killed with SIGKILL).

    python tests/faults/nats_member.py URL STREAM TOPIC GROUP LOGFILE

Subscribes, writes ``ready`` to LOGFILE, then fetches forever: for each message it writes
``got <payload>``, acks every other one (``acking <payload>`` before the ack, ``acked
<payload>`` once it went out) and leaves the rest unacked, as a stuck handler would.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig


async def main(url: str, stream: str, topic: str, group: str, log: TextIO) -> None:
    config = NatsBrokerConfig.from_url(
        f"{url}?stream={stream}&ack_wait=2&heartbeat_interval=0.25&partitions=4"
    )
    async with NatsBroker(config) as broker:
        sub = await broker.subscribe(topic, group=group)
        log.write("ready\n")
        n = 0
        while True:
            for d in await sub.fetch(4, 0.5):
                n += 1
                log.write(f"got {d.payload.decode()}\n")
                if n % 2:
                    log.write(f"acking {d.payload.decode()}\n")
                    await d.ack()
                    await broker._connection().flush()
                    log.write(f"acked {d.payload.decode()}\n")


if __name__ == "__main__":
    url, stream, topic, group, path = sys.argv[1:6]
    with open(path, "a", buffering=1) as out:  # line-buffered: one write(2) per line
        asyncio.run(main(url, stream, topic, group, out))
