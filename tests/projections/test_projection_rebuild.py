"""Rebuild: reset + replay of the whole log gives exactly the state live processing gave."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from projection_support import (
    ItemAdded,
    ItemRemoved,
    StockLevels,
    Waiter,
    append_events,
    opened,
    running,
)

from eventflow.adapters.memory.store import MemoryStore
from eventflow.ports import Store, Transaction
from eventflow.projections import (
    Projection,
    ProjectionContext,
    ProjectionError,
    ProjectionHandlerError,
    ProjectionLockedError,
    ProjectionRunner,
)
from eventflow.sourcing.on import on
from eventflow.testing.postgres import isolated_schema, postgres_url

EVENTS = 20_000


class SqlStockLevels(Projection, name="projtest_sql_stock"):
    """The SQL-store way: state in a table written through ctx.transaction()."""

    def __init__(self) -> None:
        self.upsert = (  # the same SQL on every SQL store
            "INSERT INTO projtest_stock (sku, qty) VALUES ($1, $2) "
            "ON CONFLICT (sku) DO UPDATE SET qty = projtest_stock.qty + excluded.qty"
        )

    async def reset(self, tx: Transaction) -> None:
        await tx.execute("DELETE FROM projtest_stock")

    @on(ItemAdded)
    async def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None:
        await ctx.transaction().execute(self.upsert, e.sku, e.qty)

    @on(ItemRemoved)
    async def _removed(self, e: ItemRemoved, ctx: ProjectionContext) -> None:
        await ctx.transaction().execute(self.upsert, e.sku, -e.qty)


async def _state(store: Store, projection: Projection) -> dict[str, Any]:
    if isinstance(projection, StockLevels):
        return projection.state()
    async with store.transaction() as tx:
        rows = await tx.fetch("SELECT sku, qty FROM projtest_stock ORDER BY sku")
    return {"levels": dict(rows)}


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """Each store kind with an event store: memory://, a SQLite file, a PostgreSQL schema."""
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/events.db"
    else:
        async with isolated_schema(postgres_url()) as url:
            yield url


@pytest.mark.timeout(240)
async def test_rebuild_equals_live_with_20000_events(store_url: str, waiter: Waiter) -> None:
    memory = store_url.startswith("memory:")
    async with opened(store_url) as store:
        live: Projection
        if memory:
            live = StockLevels()
        else:
            live = SqlStockLevels()
            async with store.transaction() as tx:
                await tx.execute(
                    "CREATE TABLE projtest_stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL)"
                )
        runner = ProjectionRunner(live, store, batch_size=250)
        async with running(runner):
            await waiter(lambda: runner.active, what="runner active")
            # SQL stores: fewer, larger appends keep the test fast; batches still interleave
            sizes = [1 + k * 7 for k in range(4)] if memory else [20 + k * 15 for k in range(4)]
            writers = [
                append_events(store, EVENTS // 4, start=k * (EVENTS // 4), per_append=size)
                for k, size in enumerate(sizes)
            ]
            await asyncio.gather(*writers)

            async def all_stored() -> bool:  # PostgreSQL numbers events just after commit
                return await store.last_position() == EVENTS

            await waiter(all_stored, what="every event positioned")

            async def caught_up() -> bool:
                return await store.checkpoints.get(live.name) == EVENTS

            # Not a speed check: the live runner is often 19,000 events behind when the last
            # append commits and, beside the whole suite, applies them at under 1,000/s.
            await waiter(caught_up, timeout=90, what="live projection caught up")
        live_state = await _state(store, live)
        assert live_state["levels"] and len(live_state["levels"]) == 7
        if isinstance(live, StockLevels):
            # every handled event exactly once, in global order
            assert live.positions == sorted(set(live.positions))
            assert len(live.positions) == sum(1 for i in range(EVENTS) if i % 3 != 2)

        # a fresh instance, as after a restart
        rebuilt = StockLevels() if memory else SqlStockLevels()
        calls: list[tuple[int, int]] = []
        last = await ProjectionRunner(rebuilt, store, batch_size=999).rebuild(
            progress=lambda pos, end: calls.append((pos, end))
        )
        assert last == EVENTS
        assert await _state(store, rebuilt) == live_state
        assert await store.checkpoints.get(live.name) == EVENTS
        assert calls[0] == (0, EVENTS) and calls[-1] == (EVENTS, EVENTS)
        assert [p for p, _ in calls] == sorted(p for p, _ in calls)

        if memory:  # rebuilding the live object itself: reset() clears its attributes
            await ProjectionRunner(live, store).rebuild()
            assert await _state(store, live) == live_state


async def test_live_runner_continues_after_a_rebuild(waiter: Waiter) -> None:
    store = MemoryStore()
    await append_events(store, 50)
    projection = StockLevels()
    assert await ProjectionRunner(projection, store, batch_size=8).rebuild() == 50
    await append_events(store, 25, start=50)
    runner = ProjectionRunner(projection, store)
    async with running(runner):
        await waiter(lambda: store.checkpoints._positions.get(projection.name) == 75)
    assert projection.positions == [i + 1 for i in range(75) if i % 3 != 2]


async def test_rebuild_of_an_empty_store_reports_zero() -> None:
    calls: list[tuple[int, int]] = []
    projection = StockLevels()
    projection.levels["stale"] = 3
    assert (
        await ProjectionRunner(projection, MemoryStore()).rebuild(
            progress=lambda p, e: calls.append((p, e))
        )
        == 0
    )
    assert calls == [(0, 0)] and projection.levels == {}


async def test_rebuild_refuses_while_a_running_instance_holds_the_lock(waiter: Waiter) -> None:
    store = MemoryStore()
    await append_events(store, 5)
    runner = ProjectionRunner(StockLevels(), store)
    async with running(runner):
        await waiter(lambda: runner.active)
        with pytest.raises(ProjectionError, match="call stop\\(\\)"):
            await runner.rebuild()
        other = ProjectionRunner(StockLevels(), store)
        with pytest.raises(ProjectionLockedError, match="stop that app"):
            await other.rebuild(lock_timeout=0.05)
        assert await other.is_locked(timeout=0.05)
        assert (await other.status(probe_lock=0.05)).running is True
    assert not await other.is_locked(timeout=0.05)
    assert (await other.status(probe_lock=0.05)).running is False


async def test_projection_without_reset_cannot_be_rebuilt() -> None:
    class NoReset(Projection, name="projtest_noreset"):
        @on(ItemAdded)
        async def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None: ...

    store = MemoryStore()
    await store.checkpoints.set("projtest_noreset", 4)
    with pytest.raises(ProjectionError, match="does not override `async def reset"):
        await ProjectionRunner(NoReset(), store).rebuild()
    assert await store.checkpoints.get("projtest_noreset") == 4  # nothing was dropped


async def test_failing_rebuild_stops_at_the_last_good_batch() -> None:
    class Poisoned(StockLevels, name="projtest_poisoned"):
        @on(ItemAdded)
        async def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None:
            if ctx.position == 25:
                raise ValueError("bad data")
            await super()._added(e, ctx)

    store = MemoryStore()
    await append_events(store, 40)
    projection = Poisoned()
    with pytest.raises(ProjectionHandlerError, match="@25") as info:
        await ProjectionRunner(projection, store, batch_size=10).rebuild()
    assert isinstance(info.value.__cause__, ValueError)
    # Python state: the events before the poison one are in, and checkpointed
    assert await store.checkpoints.get(projection.name) == 24
    assert projection.positions == [i + 1 for i in range(24) if i % 3 != 2]
