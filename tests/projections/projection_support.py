"""Events, projections and stores shared by the projection tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from eventflow import Event
from eventflow.adapters.memory.transactions import MemoryTransaction
from eventflow.ports import Store, Transaction
from eventflow.projections import Projection, ProjectionContext, ProjectionRunner
from eventflow.sourcing.on import on
from eventflow.stores import store_for


class ItemAdded(Event, type="projtest.item.added"):
    """Stock of a sku goes up."""

    sku: str
    qty: int


class ItemRemoved(Event, type="projtest.item.removed"):
    """Stock of a sku goes down."""

    sku: str
    qty: int


class ItemRenamed(Event, type="projtest.item.renamed"):
    """An event the stock projection has no handler for."""

    sku: str
    name: str


class StockLevels(Projection, name="projtest_stock"):
    """State in Python attributes (the memory:// way), plus what it saw, for checks."""

    def __init__(self) -> None:
        self.levels: dict[str, int] = {}
        self.positions: list[int] = []
        self.streams: dict[str, int] = {}

    async def reset(self, tx: Transaction) -> None:
        self.levels.clear()
        self.positions.clear()
        self.streams.clear()

    @on(ItemAdded)
    async def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None:
        self._count(ctx)
        self.levels[e.sku] = self.levels.get(e.sku, 0) + e.qty

    @on(ItemRemoved)
    async def _removed(self, e: ItemRemoved, ctx: ProjectionContext) -> None:
        self._count(ctx)
        self.levels[e.sku] = self.levels.get(e.sku, 0) - e.qty

    def _count(self, ctx: ProjectionContext) -> None:
        assert ctx.record is not None
        self.positions.append(ctx.position)
        self.streams[ctx.record.stream_id] = ctx.record.stream_version

    def state(self) -> dict[str, Any]:
        """Everything the projection computed."""
        return {"levels": dict(self.levels), "streams": dict(self.streams)}


def event_for(i: int) -> Event:
    """The i-th event of a deterministic mix of types (a third are ignored renames)."""
    sku = f"sku-{i % 7}"
    kind = i % 3
    if kind == 0:
        return ItemAdded(sku=sku, qty=1 + i % 5)
    if kind == 1:
        return ItemRemoved(sku=sku, qty=1 + i % 2)
    return ItemRenamed(sku=sku, name=f"name-{i}")


async def append_events(store: Store, n: int, *, start: int = 0, per_append: int = 10) -> None:
    """Append n events over 13 streams, ``per_append`` at a time (yielding in between)."""
    i = start
    while i < start + n:
        count = min(per_append, start + n - i)
        stream = f"item-{i % 13}"
        await store.append(stream, [event_for(j) for j in range(i, i + count)])
        i += count
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def opened(url: str) -> AsyncIterator[Store]:
    """An opened store for ``url``."""
    store = store_for(url)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def running(runner: ProjectionRunner) -> AsyncIterator[asyncio.Task[None]]:
    """``runner.run()`` in a task for the block; cancelled (and awaited) at the end."""
    task = asyncio.create_task(runner.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def in_tx(tx: Any, action: Callable[[], object]) -> None:
    """Apply ``action`` when the memory transaction ``tx`` commits (transactional state)."""
    assert isinstance(tx, MemoryTransaction) or hasattr(tx, "defer")
    tx.defer(action)


Waiter = Callable[..., Coroutine[Any, Any, None]]
