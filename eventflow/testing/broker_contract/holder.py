"""A group member in its own process that fetches messages and never acks them, for the
broker contract's dead-member lag case (it is SIGKILLed while it holds them).

``python -m eventflow.testing.broker_contract.holder URL PATTERN GROUP COUNT``: opens the
broker at ``URL`` (``eventflow.brokers.open_broker``), joins ``GROUP`` on ``PATTERN``
(created at ``latest`` if new), prints ``joined``, fetches until it holds ``COUNT``
deliveries (acking none), prints ``held COUNT`` and then waits to be killed. Every line is
flushed at once.
"""

from __future__ import annotations

import asyncio
import sys

from ...brokers import open_broker
from ...ports import Delivery

__all__ = ["hold"]

_FETCH_WAIT = 0.5


async def hold(url: str, pattern: str, group: str, count: int) -> None:
    """Join, hold ``count`` deliveries unacked, report, and wait for ever."""
    broker = open_broker(url)
    await broker.start()
    sub = await broker.subscribe(pattern, group=group)
    print("joined", flush=True)
    held: list[Delivery] = []
    while len(held) < count:
        held.extend(await sub.fetch(count - len(held), _FETCH_WAIT))
    print(f"held {len(held)}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(hold(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
