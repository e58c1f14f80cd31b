"""ProjectionRunner live processing on the memory store: batches, checkpoints, failures,
one active instance with takeover, stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from projection_support import (
    ItemAdded,
    ItemRemoved,
    StockLevels,
    Waiter,
    append_events,
    event_for,
    in_tx,
    running,
)

from eventflow import ConfigurationError
from eventflow.adapters.memory.store import MemoryStore
from eventflow.ports import Transaction
from eventflow.projections import (
    Projection,
    ProjectionContext,
    ProjectionError,
    ProjectionHandlerError,
    ProjectionRunner,
    lease_name,
)
from eventflow.sourcing.on import on


def test_projection_declares_name_and_handled_types() -> None:
    assert StockLevels.name == "projtest_stock"
    assert StockLevels.handled_types() == ("projtest.item.added", "projtest.item.removed")
    assert repr(StockLevels()) == "<StockLevels projection 'projtest_stock'>"


def test_sync_handler_and_bad_name_are_rejected() -> None:
    with pytest.raises(ConfigurationError, match="not `async def`"):

        class _Sync(Projection, name="sync"):
            @on(ItemAdded)
            def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None: ...

    with pytest.raises(ConfigurationError, match="projection name"):

        class _Bad(Projection, name="has space"):
            pass


def test_runner_needs_a_named_projection_instance() -> None:
    class Nameless(Projection):
        pass

    with pytest.raises(ConfigurationError, match="has no name"):
        ProjectionRunner(Nameless(), MemoryStore())
    with pytest.raises(ConfigurationError, match="pass StockLevels\\(\\), not StockLevels"):
        ProjectionRunner(StockLevels, MemoryStore())  # type: ignore[arg-type]


async def test_live_run_handles_events_skips_others_and_checkpoints(waiter: Waiter) -> None:
    store = MemoryStore()
    await append_events(store, 30)
    projection = StockLevels()
    runner = ProjectionRunner(projection, store, batch_size=7)
    async with running(runner):
        await waiter(lambda: runner.active, what="runner active")
        await append_events(store, 30, start=30)
        await waiter(
            lambda: store.checkpoints._positions.get(projection.name) == 60, what="checkpoint"
        )
        status = await runner.status()
    assert status.checkpoint == 60 and status.last_position == 60 and status.lag == 0
    assert status.running is True
    # only the two handled types reached the projection, each once, in order
    handled = [i + 1 for i in range(60) if i % 3 != 2]
    assert projection.positions == handled
    expected = StockLevels()
    for i in range(60):
        e = event_for(i)
        if isinstance(e, ItemAdded):
            expected.levels[e.sku] = expected.levels.get(e.sku, 0) + e.qty
        elif isinstance(e, ItemRemoved):
            expected.levels[e.sku] = expected.levels.get(e.sku, 0) - e.qty
    assert projection.levels == expected.levels
    assert not runner.active


async def test_context_exposes_record_position_store_and_transaction(waiter: Waiter) -> None:
    seen: list[tuple[int, str, int, bool, bool]] = []

    class Probe(Projection, name="projtest_probe"):
        @on(ItemAdded)
        async def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None:
            assert ctx.record is not None
            tx = ctx.transaction()
            seen.append(
                (
                    ctx.position,
                    ctx.record.stream_id,
                    ctx.record.stream_version,
                    ctx.store is store,
                    isinstance(tx, Transaction),
                )
            )

    store = MemoryStore()
    await store.append("a", [ItemAdded(sku="x", qty=1), ItemAdded(sku="y", qty=2)])
    async with running(ProjectionRunner(Probe(), store)):
        await waiter(lambda: len(seen) == 2, what="two events")
    assert seen == [(1, "a", 1, True, True), (2, "a", 2, True, True)]


async def test_failing_handler_is_retried_without_duplicates_on_python_state(
    waiter: Waiter, caplog: pytest.LogCaptureFixture
) -> None:
    """Memory state is not transactional: the events before the failing one in its batch
    are checkpointed, the failing one is retried until it passes; no event counts twice."""
    failures = {"left": 3}

    class Flaky(StockLevels, name="projtest_flaky"):
        @on(ItemAdded)
        async def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None:
            if ctx.position == 13 and failures["left"] > 0:
                failures["left"] -= 1
                raise RuntimeError("database hiccup")
            await super()._added(e, ctx)

    store = MemoryStore()
    await append_events(store, 30)
    projection = Flaky()
    runner = ProjectionRunner(projection, store, batch_size=10, retry_initial_delay=0.01)
    with caplog.at_level(logging.WARNING, logger="eventflow.projections"):
        async with running(runner):
            await waiter(lambda: store.checkpoints._positions.get(projection.name) == 30)
    assert failures["left"] == 0 and runner.failures == 3
    assert isinstance(runner.last_error, ProjectionHandlerError)
    assert runner.last_error.position == 13
    assert runner.last_error.event_type == "projtest.item.added"
    assert projection.positions == [i + 1 for i in range(30) if i % 3 != 2]
    assert "failed on event @13" in caplog.text and "database hiccup" in caplog.text


async def test_failed_batch_rolls_back_transactional_state(waiter: Waiter) -> None:
    """With state written through ctx.transaction() (atomic_state), a failed batch leaves
    neither writes nor checkpoint; the retry handles the whole batch once."""
    fail = asyncio.Event()
    fail.set()
    applied: list[int] = []

    class Transactional(Projection, name="projtest_tx"):
        @on(ItemAdded, ItemRemoved)
        async def _any(self, e: ItemAdded | ItemRemoved, ctx: ProjectionContext) -> None:
            position = ctx.position
            in_tx(ctx.transaction(), lambda: applied.append(position))
            if position == 4 and fail.is_set():
                raise ValueError("poison")

    store = MemoryStore()
    await append_events(store, 9)
    runner = ProjectionRunner(
        Transactional(), store, batch_size=100, atomic_state=True, retry_initial_delay=0.01
    )
    async with running(runner):
        await waiter(lambda: runner.failures >= 2, what="two failed attempts")
        assert applied == [] and await store.checkpoints.get("projtest_tx") == 0
        fail.clear()
        await waiter(lambda: store.checkpoints._positions.get("projtest_tx") == 9)
    assert applied == [1, 2, 4, 5, 7, 8]


async def test_one_active_instance_and_takeover_without_gap_or_duplicate(
    waiter: Waiter,
) -> None:
    store = MemoryStore()
    shared = StockLevels()  # both instances write the same state, as a database would be
    first = ProjectionRunner(shared, store, batch_size=5)
    second = ProjectionRunner(shared, store, batch_size=5)
    async with running(first) as first_task, running(second):
        await waiter(lambda: first.active, what="first runner active")
        await append_events(store, 40)
        await waiter(lambda: store.checkpoints._positions.get(shared.name) == 40)
        assert not second.active  # waiting on the lock
        first_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first_task
        await waiter(lambda: second.active, what="second runner takes over")
        await append_events(store, 40, start=40)
        await waiter(lambda: store.checkpoints._positions.get(shared.name) == 80)
    assert shared.positions == [i + 1 for i in range(80) if i % 3 != 2]


async def test_takeover_while_events_stream_in(waiter: Waiter) -> None:
    store = MemoryStore()
    shared = StockLevels()
    first = ProjectionRunner(shared, store, batch_size=3)
    second = ProjectionRunner(shared, store, batch_size=3)
    async with running(first) as first_task, running(second):
        await waiter(lambda: first.active)
        writer = asyncio.create_task(append_events(store, 600, per_append=2))
        await waiter(lambda: len(shared.positions) > 50, what="some progress")
        first_task.cancel()
        await writer
        await waiter(lambda: store.checkpoints._positions.get(shared.name) == 600)
        assert second.active
    assert shared.positions == [i + 1 for i in range(600) if i % 3 != 2]


async def test_stop_returns_after_the_batch_and_while_waiting_for_the_lock(
    waiter: Waiter,
) -> None:
    store = MemoryStore()
    await append_events(store, 12)
    projection = StockLevels()
    runner = ProjectionRunner(projection, store)
    task = asyncio.create_task(runner.run())
    await waiter(lambda: store.checkpoints._positions.get(projection.name) == 12)
    runner.stop()
    await asyncio.wait_for(task, 5)
    assert task.done() and not task.cancelled() and not runner.active

    async with store.leases.hold(lease_name(projection.name)):
        waiting = ProjectionRunner(StockLevels(), store)
        task = asyncio.create_task(waiting.run())
        await waiter(lambda: waiting._serving is not None, what="waiting runner started")
        waiting.stop()
        waiting.stop()  # idempotent
        await asyncio.wait_for(task, 5)
        assert not waiting.active and task.exception() is None


async def test_run_twice_is_an_error(waiter: Waiter) -> None:
    runner = ProjectionRunner(StockLevels(), MemoryStore())
    async with running(runner):
        await waiter(lambda: runner.active)
        with pytest.raises(ProjectionError, match="already running"):
            await runner.run()


class _FlakyStore(MemoryStore):
    """A memory store whose first ``subscribe`` fails after two events (a dropped link)."""

    def __init__(self) -> None:
        super().__init__()
        self.subscriptions = 0

    async def subscribe(self, *, after: int = 0):  # type: ignore[no-untyped-def, override]
        self.subscriptions += 1
        n = 0
        async for rec in super().subscribe(after=after):
            if self.subscriptions == 1 and n == 2:
                raise ConnectionError("link dropped")
            n += 1
            yield rec


async def test_store_read_failure_is_retried_from_the_checkpoint(waiter: Waiter) -> None:
    store = _FlakyStore()
    await append_events(store, 9)
    projection = StockLevels()
    runner = ProjectionRunner(projection, store, batch_size=1, retry_initial_delay=0.01)
    async with running(runner):
        await waiter(lambda: store.checkpoints._positions.get(projection.name) == 9)
    assert store.subscriptions == 2 and isinstance(runner.last_error, ConnectionError)
    assert projection.positions == [1, 2, 4, 5, 7, 8]


async def test_unknown_event_type_for_a_handler_stalls_instead_of_skipping(
    waiter: Waiter,
) -> None:
    from eventflow import Envelope
    from eventflow.envelope import new_id

    store = MemoryStore()
    bad = Envelope(id=new_id(), type="projtest.item.added", version=9, source="x", data={})
    await store.append("a", [ItemAdded(sku="s", qty=1), bad, ItemAdded(sku="s", qty=1)])
    projection = StockLevels()
    runner = ProjectionRunner(projection, store, retry_initial_delay=0.01)
    async with running(runner):
        await waiter(lambda: runner.failures >= 2, what="retries of the future version")
    assert isinstance(runner.last_error, ProjectionHandlerError)
    assert runner.last_error.position == 2 and "FutureVersionError" in str(runner.last_error)
    assert await store.checkpoints.get(projection.name) == 1  # stalled before the event
    assert projection.positions == [1]
