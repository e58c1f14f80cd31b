"""``app.wait_idle()``: returns once what was published has been handled or dead-lettered,
including the hops it caused through the outbox; times out naming what is still busy.

Run on memory + SQLite and on NATS + PostgreSQL (the plugin's ``nats_url`` and a
``postgres_url`` schema of the test's own).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from eventflow import (
    App,
    ConfigurationError,
    Context,
    Event,
    IdleTimeoutError,
    Reject,
    open_store,
    subscribe,
)
from eventflow.events import envelope_for
from eventflow.runtime.idle import busy_lines
from eventflow.testing.plugin import AppFactory


class IdleFirst(Event, type="waitidle.first"):
    n: int


class IdleSecond(Event, type="waitidle.second"):
    n: int


SETUPS = [
    pytest.param("memory-sqlite", id="memory-sqlite"),
    pytest.param("nats-postgres", id="nats-postgres", marks=pytest.mark.service("nats")),
]


@pytest.fixture(params=SETUPS)
def make(
    request: pytest.FixtureRequest, tmp_path: Path, broker_url: str, make_app: AppFactory
) -> Callable[..., Awaitable[App]]:
    """``await make(*handlers)``: a started app on the setup's broker and store (the
    plugin's ``make_app``, which stops it after the test)."""
    if request.param == "memory-sqlite":
        broker, store = broker_url, f"sqlite:///{tmp_path / 'idle.db'}"
    else:
        nats: str = request.getfixturevalue("nats_url")
        broker = f"{nats}?stream=EFIDLE{uuid.uuid4().hex[:10].upper()}&storage=memory"
        store = request.getfixturevalue("postgres_url")

    async def build(*handlers: Any) -> App:
        return await make_app(*handlers, name="idle", broker=broker, store=store)

    return build


def _groups() -> tuple[str, str]:
    unique = uuid.uuid4().hex[:8]
    return f"hop1{unique}", f"hop2{unique}"


async def test_a_chain_through_the_outbox_is_idle_only_after_its_second_hop(
    make: Callable[..., Awaitable[App]],
) -> None:
    first_group, second_group = _groups()
    seen: list[int] = []

    @subscribe("waitidle.first", group=first_group)
    async def hop1(event: IdleFirst, ctx: Context) -> None:
        async with ctx.transaction():  # the second hop goes through the outbox
            await ctx.publish(IdleSecond(n=event.n))

    @subscribe("waitidle.second", group=second_group)
    async def hop2(event: IdleSecond, ctx: Context) -> None:
        await asyncio.sleep(0.05)  # slower than a look: an early return would miss it
        seen.append(event.n)

    app = await make(hop1, hop2)
    for n in range(5):
        await app.publish(IdleFirst(n=n), key=f"k{n}")
    await app.wait_idle(timeout=30)
    assert sorted(seen) == [0, 1, 2, 3, 4]
    totals = {c.group: c.stats.handled for c in app.consumers}
    assert totals == {first_group: 5, second_group: 5}


async def test_a_pending_message_is_not_idle_and_the_timeout_names_its_group(
    make: Callable[..., Awaitable[App]],
) -> None:
    first_group, second_group = _groups()
    gate = asyncio.Event()
    seen: list[int] = []

    @subscribe("waitidle.first", group=first_group)
    async def hop1(event: IdleFirst, ctx: Context) -> None:
        async with ctx.transaction():
            await ctx.publish(IdleSecond(n=event.n))

    @subscribe("waitidle.second", group=second_group)
    async def hop2(event: IdleSecond, ctx: Context) -> None:
        await gate.wait()  # the second hop holds its message until the test lets go
        seen.append(event.n)

    app = await make(hop1, hop2)
    await app.publish(IdleFirst(n=1), key="k")
    with pytest.raises(IdleTimeoutError) as caught:
        await app.wait_idle(timeout=1.0)
    assert f"group {second_group!r} on 'waitidle.second'" in str(caught.value)
    assert any(second_group in line for line in caught.value.busy)
    assert isinstance(caught.value, TimeoutError)
    assert seen == []
    gate.set()
    await app.wait_idle(timeout=30)
    assert seen == [1]


async def test_a_dead_lettered_message_counts_as_done(make: Callable[..., Awaitable[App]]) -> None:
    first_group, _ = _groups()

    @subscribe("waitidle.first", group=first_group)
    async def refuse(event: IdleFirst, ctx: Context) -> None:
        raise Reject(f"no {event.n}")

    app = await make(refuse)
    await app.publish(IdleFirst(n=7), key="k")
    await app.wait_idle(timeout=30)
    letters = await app.dead_letters.list()
    assert [(d.group, d.reason) for d in letters] == [(first_group, "rejected")]


async def test_wait_idle_outside_a_running_app_says_to_start_it(broker_url: str) -> None:
    app = App("idle", broker=broker_url)
    with pytest.raises(ConfigurationError, match="not running"):
        await app.wait_idle(timeout=1)


async def test_outbox_rows_count_as_busy_until_the_relay_removed_them(tmp_path: Path) -> None:
    # No app, so no relay: the rows stay until the test removes them, as a slow relay's would.
    async with open_store(f"sqlite:///{tmp_path / 'outbox.db'}") as store:
        env = envelope_for(IdleFirst(n=1), source="idle")
        await store.outbox.add([("waitidle.first", env)])
        assert await busy_lines([], store, []) == ["outbox: 1 rows not yet relayed to the broker"]
        await store.outbox.remove([m.seq for m in await store.outbox.pending()])
        assert await busy_lines([], store, []) == []


async def test_a_timeout_of_zero_is_refused(broker_url: str) -> None:
    async with App("idle", broker=broker_url) as app:
        with pytest.raises(ConfigurationError, match="above 0"):
            await app.wait_idle(timeout=0)
