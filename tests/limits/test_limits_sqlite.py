"""Cluster limits through a SQLite file (processes on one machine): two stores on one file
share the slots; a limit taken inside ``ctx.transaction()`` commits its slot apart from the
handler's transaction; an open breaker shows in the heartbeat ``eventflow status`` reads."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from eventflow import App, Breaker, Context, Event, Limit, LimitTimeoutError, subscribe
from eventflow.cli.status import render
from eventflow.limits.shared import SharedSlots
from eventflow.testing.postgres import isolated_schema, postgres_url

Wait = Callable[..., Awaitable[None]]


class Ping(Event, type="it.limits.sqlite.ping"):
    n: int


class Down(Exception):
    """The dependency is down."""


async def test_two_stores_on_one_file_share_the_slots(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'limits.db'}"
    limit = Limit("api", concurrency=2, scope="cluster", timeout=0.0)
    async with (
        App("one", store=url, limits=[limit]) as one,
        App("two", store=url, limits=[limit]) as two,
    ):
        a, b = one.limits.limiter("api").slots, two.limits.limiter("api").slots
        assert isinstance(a, SharedSlots) and isinstance(b, SharedSlots)
        first = await a.take(0.0)
        second = await b.take(0.0)
        with pytest.raises(LimitTimeoutError):
            await a.take(0.0)  # both slots are held, one by each
        with pytest.raises(LimitTimeoutError):
            await b.take(0.0)
        await a.give(first)
        third = await b.take(0.0)  # the freed one, from the other store
        await b.give(second)
        await b.give(third)


async def test_a_limit_inside_the_handlers_transaction_on_postgres(
    broker_url: str, waiter: Wait
) -> None:
    """PostgreSQL: the slot is taken on a connection of its own and commits at once. (Not
    on SQLite, whose file has one writer: a limit taken inside the handler's write
    transaction would wait for that transaction; take it around the transaction there.)"""
    done: list[int] = []

    @subscribe("it.limits.sqlite.ping", group="tx")
    async def handle(event: Ping, ctx: Context) -> None:
        async with ctx.transaction() as tx:
            await tx.execute("CREATE TABLE IF NOT EXISTS seen (n INTEGER)")
            async with ctx.limit("api"):
                await tx.execute("INSERT INTO seen (n) VALUES ($1)", event.n)
        done.append(event.n)

    limit = Limit("api", concurrency=1, scope="cluster")
    async with isolated_schema(postgres_url()) as url:
        app = App("tx", broker=broker_url, store=url, handlers=[handle], limits=[limit])
        async with app:
            await app.publish(Ping(n=1))
            await app.publish(Ping(n=2))
            # handled: committed (the transaction commits after the handler returns)
            await waiter(lambda: app.consumers[0].stats.handled == 2, timeout=20)
            assert sorted(done) == [1, 2]
            assert app.stats()["limit:api"]["entered"] == 2
            assert app.consumers[0].stats.given_back == 0
            async with app.store.transaction() as tx:
                rows = await tx.fetch("SELECT n FROM seen ORDER BY n")
    assert [r[0] for r in rows] == [1, 2]


async def test_an_open_breaker_shows_in_the_status(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'status.db'}"
    breaker = Breaker(failures=1, reset=60.0, on=(Down,))
    async with App("status", store=url, limits=[Limit("api", breaker=breaker)]) as app:
        assert app.health().status == "ok"  # a positive control: closed, nothing shown
        with pytest.raises(Exception, match="is open"):
            async with app.limits.take("api"):
                raise Down("503")
        heartbeater = app._heartbeater
        assert heartbeater is not None
        await heartbeater.beat()
        beats = await app.store.heartbeats.list()
        await asyncio.sleep(0)
    [beat] = beats
    assert beat.health == "degraded"
    text = render(beats, {}, now=beat.last_seen)
    assert "breaker api OPEN" in text and "Down: 503" in text
