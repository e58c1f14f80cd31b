"""A consumer's lag: ``Consumer.lag()`` is its group's ``Broker.lag`` on its pattern, seen
while its handler holds a message."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from eventflow import App, Event, Lag, subscribe

Wait = Callable[..., Awaitable[None]]


class Job(Event, type="it.lag.job"):
    n: int


async def test_a_consumer_tells_its_groups_lag(broker_url: str, waiter: Wait) -> None:
    release = asyncio.Event()
    started: list[int] = []

    @subscribe("it.lag.job", group="it-lag", concurrency=1)
    async def handle(event: Job) -> None:
        started.append(event.n)
        await release.wait()

    async with App("it-lag", broker=broker_url, handlers=[handle]) as app:
        [consumer] = app.consumers
        assert await consumer.lag() == Lag(0, None)
        before = datetime.now(UTC)
        for n in range(3):
            await app.publish(Job(n=n), key="k")
        await waiter(lambda: started == [0], what="the first job held by its handler")
        lag = await consumer.lag()
        assert lag.messages == 3 and lag.oldest is not None
        assert before - timedelta(seconds=1) <= lag.oldest <= datetime.now(UTC)
        assert lag == await app.broker.lag("it.lag.job", group="it-lag")
        release.set()

        async def drained() -> bool:
            return await consumer.lag() == Lag(0, None)

        await waiter(drained, what="the group's lag back to nothing")
