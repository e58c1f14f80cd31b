"""Projection runners under leases, on SQLite and PostgreSQL: the ``setup`` hook, and the
split brain of two runners when the active one loses its lease mid-run.

Two ways to lose it: its renewals blocked (another connection locks the file or the lease
row), which its keeper notices within about ttl; and renewals that hang while the runner
believes it still holds the lease (a paused or partitioned process, see
``eventflow.testing.lease_faults``), which only the fence of its batch commit stops. Either
way every event is applied exactly once and the other runner continues.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from projection_support import ItemAdded, Waiter

from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres.db import PostgresConfig
from eventflow.adapters.sqlite.store import SqliteStore
from eventflow.errors import LeaseLostError, StoreError
from eventflow.ports import Store, Transaction
from eventflow.projections import Projection, ProjectionContext, ProjectionRunner, lease_name
from eventflow.sourcing.on import on
from eventflow.supervision import RestartPolicy, Supervisor
from eventflow.testing import unique_name
from eventflow.testing.lease_faults import unaware_of_loss
from eventflow.testing.postgres import isolated_schema, postgres_url

TTL = 1.5
LEASE = lease_name("projtest_applied")


class Applied(Projection, name="projtest_applied"):
    """One row per handled event, naming the runner that handled it (no key: a duplicate
    would be a second row)."""

    def __init__(self, runner: str) -> None:
        self.runner = runner
        self.setups = 0
        self.handled = 0

    async def setup(self, tx: Transaction) -> None:
        self.setups += 1
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS projtest_applied (position BIGINT NOT NULL, "
            "runner TEXT NOT NULL)"
        )

    async def reset(self, tx: Transaction) -> None:
        await tx.execute("DELETE FROM projtest_applied")

    @on(ItemAdded)
    async def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None:
        self.handled += 1
        await ctx.transaction().execute(
            "INSERT INTO projtest_applied (position, runner) VALUES ($1, $2)",
            ctx.position,
            self.runner,
        )


class Backend:
    """Stores of one SQL database with a short lease ttl, and how to block its renewals."""

    def __init__(self, kind: str, target: str) -> None:
        self.kind = kind
        self.target = target  # the SQLite path, or the PostgreSQL URL
        self.stores: list[Store] = []

    async def store(self) -> Store:
        store: Store
        if self.kind == "sqlite":
            store = SqliteStore(self.target, busy_timeout=0.5, lease_ttl=TTL)
        else:
            config = PostgresConfig.from_url(self.target)
            store = PostgresStore(dataclasses.replace(config, lease_ttl=TTL))
        self.stores.append(store)
        await store.open()
        return store

    @contextlib.asynccontextmanager
    async def block_renewals(self) -> AsyncIterator[None]:
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.target, isolation_level=None, check_same_thread=False)
            await asyncio.to_thread(conn.execute, "BEGIN EXCLUSIVE")
            try:
                yield
            finally:
                await asyncio.to_thread(conn.execute, "ROLLBACK")
                conn.close()
            return
        config = PostgresConfig.from_url(self.target)
        pg = await asyncpg.connect(config.dsn, server_settings={"search_path": config.schema})
        try:
            async with pg.transaction():
                await pg.execute("SELECT 1 FROM ef_leases WHERE name = $1 FOR UPDATE", LEASE)
                yield
        finally:
            await pg.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.service("postgres"))])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """SQLite (a new file) or PostgreSQL (a new schema)."""
    async with contextlib.AsyncExitStack() as stack:
        if request.param == "sqlite":
            found = Backend("sqlite", str(tmp_path / "leases.db"))
        else:
            url = await stack.enter_async_context(isolated_schema(postgres_url()))
            found = Backend("postgres", url)
        try:
            yield found
        finally:
            for store in found.stores:
                await store.close()


async def applied(store: Store) -> list[tuple[int, str]]:
    """Every (position, runner) row of the projection, by position."""
    async with store.transaction() as tx:
        rows = await tx.fetch("SELECT position, runner FROM projtest_applied ORDER BY position")
    return [(int(p), str(r)) for p, r in rows]


class Writer:
    """Appends an ItemAdded every ``pace`` seconds until stopped (trying again when the
    store refuses a write: SQLite is locked while renewals are blocked). ``stop`` lets the
    append in progress finish, so ``appended`` is exactly what the store holds (cancelling
    an append could leave it committed and uncounted)."""

    def __init__(self, store: Store, pace: float = 0.02) -> None:
        self.store = store
        self.pace = pace
        self.appended = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.store.append(f"item-{self.appended % 5}", [ItemAdded(sku="s", qty=1)])
            except StoreError:
                await asyncio.sleep(0.05)
                continue
            self.appended += 1
            await asyncio.sleep(self.pace)

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> int:
        if self._task is not None and not self._task.done():
            self._stopping = True
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 30)
            except TimeoutError:
                self._task.cancel()
                raise
        return self.appended


def assert_each_once(rows: list[tuple[int, str]], total: int) -> None:
    positions = [p for p, _ in rows]
    assert positions == list(range(1, total + 1)), (
        f"events applied more than once or not at all: {len(positions)} rows for {total} "
        f"events, duplicates {sorted({p for p in positions if positions.count(p) > 1})}"
    )


async def test_setup_creates_the_tables_before_the_first_event(
    backend: Backend, waiter: Waiter
) -> None:
    """On a fresh database the projection's table exists before its first event is handled
    (the handler writes into it); a rebuild runs setup before reset (which deletes from it),
    so it works on a database without the table too."""
    store = await backend.store()
    await store.append("item-0", [ItemAdded(sku="s", qty=1) for _ in range(5)])
    projection = Applied("live")
    runner = ProjectionRunner(projection, store)
    task = asyncio.create_task(runner.run())
    try:
        await waiter(lambda: _checkpoint(store, 5), what="live runner done")
        assert projection.setups == 1
    finally:
        runner.stop()
        await asyncio.wait_for(task, 10)
    assert [r for _, r in await applied(store)] == ["live"] * 5

    async with store.transaction() as tx:
        await tx.execute("DROP TABLE projtest_applied")
    rebuilt = Applied("rebuild")
    assert await ProjectionRunner(rebuilt, await backend.store()).rebuild() == 5
    assert rebuilt.setups == 1
    assert [r for _, r in await applied(store)] == ["rebuild"] * 5


async def test_renewals_blocked_the_other_runner_takes_over_each_event_once(
    backend: Backend, waiter: Waiter
) -> None:
    """The active runner's renewals blocked for longer than ttl: it stops with
    LeaseLostError (its batch in progress rolled back), the other runner takes over from
    the checkpoint; at no moment are both active, and every event is applied once. Made
    active again later, the first runner runs setup again, harmlessly, and continues."""
    first_store, second_store, writer_store = [await backend.store() for _ in range(3)]
    first_projection = Applied("first")
    second_projection = Applied("second")
    first = ProjectionRunner(first_projection, first_store, batch_size=10)
    second = ProjectionRunner(second_projection, second_store, batch_size=10)
    supervisor = Supervisor(
        "test", RestartPolicy(initial_delay=0.05, max_delay=0.2, give_up_after=None)
    )
    writer = Writer(writer_store)
    overlaps: list[int] = []

    async def sample() -> None:
        while True:
            if first.active and second.active:
                overlaps.append(writer.appended)
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(sample())
    first_task = asyncio.create_task(first.run())
    try:
        await waiter(lambda: first.active, what="first runner active")
        supervisor.spawn("second", second.run)  # restarted when SQLite refuses its tries
        writer.start()
        await waiter(lambda: first_projection.handled >= 20, what="first runner progress")
        async with backend.block_renewals():
            with pytest.raises(LeaseLostError):
                await asyncio.wait_for(first_task, TTL * 3)
            assert not first.active
        await waiter(lambda: second.active, timeout=TTL + 10, what="second runner takes over")
        await waiter(lambda: second_projection.handled >= 20, what="second runner progress")
        total = await writer.stop()
        await waiter(
            lambda: _checkpoint(second_store, total), timeout=15, what="second runner done"
        )
        rows = await applied(second_store)
        assert_each_once(rows, total)
        assert {r for _, r in rows} == {"first", "second"}
        assert overlaps == [], "both runners were active at once"

        # the second runner stops; the first, made active again, runs setup again
        await supervisor.close()
        assert first_projection.setups == 1
        first_task = asyncio.create_task(first.run())
        await waiter(lambda: first.active, timeout=TTL + 10, what="first runner active again")
        assert first_projection.setups == 2
        await writer_store.append("item-x", [ItemAdded(sku="s", qty=1)])
        await waiter(lambda: _checkpoint(first_store, total + 1), what="first runner continues")
        assert_each_once(await applied(first_store), total + 1)
    finally:
        await writer.stop()
        await supervisor.close()
        first.stop()
        sampler.cancel()
        for task in (first_task, sampler):
            with contextlib.suppress(BaseException):
                await task


async def test_a_runner_unaware_of_its_lost_lease_is_refused_by_the_fence(
    backend: Backend, waiter: Waiter
) -> None:
    """The active runner's renewals hang while it still believes it holds the lease (a
    paused or partitioned process): the other runner takes the lease once it expired, and
    the first runner's next batch, already handled, is refused at its commit
    (LeaseLostError out of run()); every event is applied once."""
    first_store, second_store, writer_store = [await backend.store() for _ in range(3)]
    stale = unaware_of_loss(first_store)
    first_projection = Applied("first")
    second_projection = Applied("second")
    first = ProjectionRunner(first_projection, stale.store, batch_size=5)
    second = ProjectionRunner(second_projection, second_store, batch_size=5)
    supervisor = Supervisor(
        "test", RestartPolicy(initial_delay=0.05, max_delay=0.2, give_up_after=None)
    )
    writer = Writer(writer_store, pace=0.03)
    first_task = asyncio.create_task(first.run())
    try:
        await waiter(lambda: first.active, what="first runner active")
        supervisor.spawn("second", second.run)
        writer.start()
        await waiter(lambda: first_projection.handled >= 10, what="first runner progress")
        stale.stall()
        await waiter(lambda: second.active, timeout=TTL + 10, what="second runner takes over")
        with pytest.raises(LeaseLostError, match="another holder took it over") as refused:
            await asyncio.wait_for(first_task, 10)
        assert "not renewed" not in str(refused.value)  # the fence said so, not its keeper
        await waiter(lambda: second_projection.handled >= 10, what="second runner progress")
        total = await writer.stop()
        await waiter(
            lambda: _checkpoint(second_store, total), timeout=15, what="second runner done"
        )
        rows = await applied(second_store)
        assert_each_once(rows, total)
        firsts = [p for p, r in rows if r == "first"]
        seconds = [p for p, r in rows if r == "second"]
        assert firsts and seconds and max(firsts) < min(seconds)
        # the refused batch was handled (a split brain) but none of it committed
        assert first_projection.handled > len(firsts)
    finally:
        await writer.stop()
        await supervisor.close()
        first.stop()
        with contextlib.suppress(BaseException):
            await first_task


async def _checkpoint(store: Store, position: int) -> bool:
    return await store.checkpoints.get("projtest_applied") == position


class SlowApplied(Applied, name="projtest_applied"):
    """``Applied`` whose handler takes a while (an I/O-bound handler)."""

    async def _added(self, e: ItemAdded, ctx: ProjectionContext) -> None:
        await asyncio.sleep(TTL / 20)
        await super()._added(e, ctx)


async def test_a_batch_longer_than_the_lease_ttl_still_progresses(
    backend: Backend, waiter: Waiter
) -> None:
    """A batch whose events take longer than the lease's ttl in all: the runner commits it
    in parts (each at most ttl / 3), so the store is never kept busy past a renewal; on
    SQLite one long transaction blocked the renewals, the lease was lost and the same batch
    was retried for ever."""
    store, writer_store = await backend.store(), await backend.store()
    total = 60  # 60 x TTL/20 = 3 ttl
    for n in range(total):
        await writer_store.append(f"item-{n}", [ItemAdded(sku="s", qty=1)])
    projection = SlowApplied("slow")
    runner = ProjectionRunner(projection, store, batch_size=total)
    supervisor = Supervisor("test", RestartPolicy(initial_delay=0.05, max_delay=0.2))
    supervisor.spawn("slow", runner.run)
    try:
        await waiter(lambda: _checkpoint(store, total), timeout=30, what="every event applied")
        assert_each_once(await applied(store), total)
        assert runner.failures == 0  # no batch was refused on the way
    finally:
        await supervisor.close()


@pytest.mark.service("postgres")
async def test_a_pool_taken_by_slow_transactions_does_not_cost_the_lease() -> None:
    """Renewals run on a connection of the leases' own: handlers holding every pooled
    connection for longer than the ttl do not make the holder lose its lease."""
    async with isolated_schema(postgres_url()) as url:
        config = dataclasses.replace(PostgresConfig.from_url(url), lease_ttl=1.0, max_pool=3)
        store = PostgresStore(config)
        await store.open()
        try:
            async with store.leases.hold(unique_name("pool")) as lease:

                async def slow() -> None:
                    async with store.transaction() as tx:
                        await tx.execute("SELECT pg_sleep(2)")

                await asyncio.gather(*(slow() for _ in range(3)))
                await asyncio.sleep(0)  # a lost lease would cancel the block here
                assert lease.lost is None
        finally:
            await store.close()
