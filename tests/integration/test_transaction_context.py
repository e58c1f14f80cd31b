"""A store transaction belongs to the context that opened it, not to the task: tasks created
inside ``ctx.transaction()`` or ``store.transaction()`` (``gather``, a ``TaskGroup``,
``wait_for``) join it and commit or roll back with it, on SQLite and on PostgreSQL; a task
that outlives the block no longer uses it. The SQL of both stores takes ``$1, $2, ...`` and
``execute`` returns the number of rows changed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from eventflow import (
    App,
    ConcurrencyError,
    ConfigurationError,
    Context,
    Event,
    Projection,
    ProjectionContext,
    RetryPolicy,
    StoreError,
    on,
    subscribe,
)
from eventflow.events import to_envelope
from eventflow.ports import Store
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url

Wait = Callable[..., Awaitable[None]]
Job = Coroutine[Any, Any, Any]

LEDGER = "CREATE TABLE IF NOT EXISTS it_ctx_ledger (n INTEGER, note TEXT)"
INSERT = "INSERT INTO it_ctx_ledger (n, note) VALUES ($1, $2)"
BOUND = 20.0  # seconds: a deadlock fails the test instead of hanging it


class CtxDeposit(Event, type="it.ctx.deposit"):
    """Money in."""

    n: int


class CtxBooked(Event, type="it.ctx.booked"):
    """Money booked."""

    n: int


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """An unopened store of each SQL kind (a fresh file, a fresh schema)."""
    if request.param == "sqlite":
        yield store_for(f"sqlite:///{tmp_path / 'ctx.db'}")
        return
    async with isolated_schema(postgres_url()) as url:
        yield store_for(url)


async def _together(how: str, *jobs: Job) -> None:
    """Run ``jobs`` in child tasks the way ``how`` says."""
    if how == "gather":
        await asyncio.gather(*jobs)
    elif how == "taskgroup":
        async with asyncio.TaskGroup() as tg:
            for job in jobs:
                tg.create_task(job)
    else:
        for job in jobs:
            await asyncio.wait_for(job, timeout=BOUND)  # a task of its own each


async def _rows(store: Store) -> list[tuple[Any, ...]]:
    async with store.transaction() as tx:
        return sorted(await tx.fetch("SELECT n, note FROM it_ctx_ledger"))


async def _versions(store: Store, stream: str) -> list[int]:
    return [rec.stream_version async for rec in store.read_stream(stream)]


@pytest.mark.parametrize("how", ["gather", "taskgroup", "wait_for"])
async def test_tasks_created_inside_a_handler_transaction_join_it(
    store: Store, how: str, broker_url: str, waiter: Wait
) -> None:
    attempts: list[int] = []

    @subscribe(
        "it.ctx.deposit", group="ledger", retry=RetryPolicy(2, initial_delay=0.01), timeout=5.0
    )
    async def book(event: CtxDeposit, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        async with ctx.transaction() as tx:
            await _together(
                how,
                tx.execute(INSERT, event.n, "a"),
                tx.execute(INSERT, event.n, "b"),
                ctx.store.append(f"acct-{event.n}", [CtxBooked(n=event.n)]),  # via the context
            )
            await ctx.publish(CtxBooked(n=event.n))
        if ctx.attempt == 1:
            raise RuntimeError("after the writes: every one of them must roll back")

    app = App(f"it-ctx-{how}", broker=broker_url, store=store, handlers=[book])
    async with app:
        async with store.transaction() as tx:
            await tx.execute(LEDGER)
        await app.publish(CtxDeposit(n=1), key="1")

        def settled() -> bool:
            stats = app.stats()["ledger:it.ctx.deposit"]
            return stats["handled"] + stats["dead_lettered"] >= 1

        await waiter(settled, timeout=BOUND, what="the deposit handled or dead-lettered")
        assert app.stats()["ledger:it.ctx.deposit"]["handled"] == 1, app.stats()
        assert attempts == [1, 2]
        assert await _rows(store) == [(1, "a"), (1, "b")]  # the first attempt left nothing
        assert await _versions(store, "acct-1") == [1]


@pytest.mark.parametrize("how", ["gather", "taskgroup", "wait_for"])
async def test_tasks_created_inside_store_transaction_commit_and_roll_back_with_it(
    store: Store, how: str
) -> None:
    async with store, asyncio.timeout(BOUND):
        async with store.transaction() as tx:
            await tx.execute(LEDGER)

        def jobs(tx: Any, n: int) -> list[Job]:
            return [
                tx.execute(INSERT, n, "sql"),
                store.checkpoints.set("it-ctx", n),
                store.append("stream", [CtxBooked(n=n)]),
                store.outbox.add([("it.ctx.booked", to_envelope(CtxBooked(n=n), source="t"))]),
            ]

        with pytest.raises(RuntimeError, match="roll back"):
            async with store.transaction() as tx:
                await _together(how, *jobs(tx, 1))
                raise RuntimeError("roll back all of it")
        assert await _rows(store) == []
        assert await store.checkpoints.get("it-ctx") == 0
        assert await _versions(store, "stream") == []
        assert await store.outbox.pending() == []

        async with store.transaction() as tx:
            await _together(how, *jobs(tx, 2))
        assert await _rows(store) == [(2, "sql")]
        assert await store.checkpoints.get("it-ctx") == 2
        assert await _versions(store, "stream") == [1]
        assert len(await store.outbox.pending()) == 1


async def test_a_task_that_outlives_the_block_no_longer_uses_its_transaction(
    store: Store,
) -> None:
    joined, release = asyncio.Event(), asyncio.Event()

    async def child() -> None:
        await store.checkpoints.set("early", 1)  # the block is open: this joins it
        joined.set()
        await release.wait()
        await store.checkpoints.set("late", 2)  # the block has committed: this runs alone

    async with store, asyncio.timeout(BOUND):
        async with store.transaction() as tx:
            await tx.execute(LEDGER)
        async with store.transaction() as tx:
            task = asyncio.create_task(child())
            await joined.wait()
            await tx.execute(INSERT, 1, "first")
        with pytest.raises(RuntimeError):
            async with store.transaction() as tx:  # another transaction of this task
                await tx.execute(INSERT, 2, "rolled back")
                release.set()
                # Time for the child's late write to slip into this transaction, were it
                # still bound to the first one's state (it must wait for this one instead).
                await asyncio.sleep(0.05)
                raise RuntimeError("roll this one back")
        await task
        assert await _rows(store) == [(1, "first")]
        assert await store.checkpoints.get("early") == 1
        assert await store.checkpoints.get("late") == 2  # committed on its own


async def test_postgres_ends_a_block_after_the_statement_a_child_task_is_running(
    postgres_store: Store,
) -> None:
    store = postgres_store
    started = asyncio.Event()

    async def slow(tx: Any) -> int:
        started.set()  # runs on until its statement is sent, before the parent wakes
        sql = "INSERT INTO it_ctx_ledger (n, note) SELECT $1, $2 FROM pg_sleep(0.3)"
        return int(await tx.execute(sql, 1, "slow"))

    async with asyncio.timeout(BOUND):
        async with store.transaction() as tx:
            await tx.execute(LEDGER)
        async with store.transaction() as tx:
            task = asyncio.create_task(slow(tx))
            await started.wait()
        # the COMMIT waited for the child's statement instead of colliding with it
        assert await task == 1
        assert await _rows(store) == [(1, "slow")]


async def test_a_transaction_used_after_its_block_says_it_has_ended(store: Store) -> None:
    async with store, asyncio.timeout(BOUND):
        async with store.transaction() as tx:
            await tx.execute(LEDGER)
        with pytest.raises(StoreError, match="has ended"):
            await tx.execute(INSERT, 1, "too late")
        with pytest.raises(StoreError, match="has ended"):
            await tx.fetch("SELECT n FROM it_ctx_ledger")
        assert await _rows(store) == []


async def test_concurrent_appends_in_one_transaction_conflict_cleanly(store: Store) -> None:
    async with store, asyncio.timeout(BOUND):
        async with store.transaction():
            results = await asyncio.gather(
                store.append("s", [CtxBooked(n=1)], expected_version=0),
                store.append("s", [CtxBooked(n=2)], expected_version=0),
                return_exceptions=True,
            )
            assert sorted(map(type, results), key=str) == sorted([int, ConcurrencyError], key=str)
            assert 1 in results
            await store.append("t", [CtxBooked(n=3)])  # the transaction goes on
        assert await _versions(store, "s") == [1]
        assert await _versions(store, "t") == [1]


async def test_a_child_task_cannot_open_a_nested_transaction(store: Store) -> None:
    async def nested() -> None:
        async with store.transaction():
            pass

    async with store, asyncio.timeout(BOUND):
        async with store.transaction():
            with pytest.raises(StoreError, match="nest nothing"):
                await asyncio.create_task(nested())
        await asyncio.create_task(nested())  # after the block: a transaction of its own


# -- one parameter style ---------------------------------------------------------------------


async def test_sql_takes_numbered_parameters_and_execute_returns_rows_changed(
    store: Store,
) -> None:
    async with store, store.transaction() as tx:
        assert await tx.execute(LEDGER) == 0
        # out of order and repeated: each number is its argument
        assert (
            await tx.execute("INSERT INTO it_ctx_ledger VALUES ($2, $1), ($3, $1)", "x", 1, 2) == 2
        )
        assert await tx.execute(f"{INSERT} RETURNING n", 3, "y") == 1
        assert await tx.fetch(
            "SELECT n, note FROM it_ctx_ledger WHERE note = $1 AND n > $2 ORDER BY n", "x", 0
        ) == [(1, "x"), (2, "x")]
        assert await tx.execute("UPDATE it_ctx_ledger SET n = n + $1 WHERE note = $2", 10, "x") == 2
        # markers inside literals, quoted identifiers and comments are text, not parameters
        assert await tx.fetch(
            "SELECT '$2 or ?' AS \"$1?\", CAST($1 AS INTEGER) -- $2 ?\n/* :x $3 */", 7
        ) == [("$2 or ?", 7)]
        assert await tx.execute("DELETE FROM it_ctx_ledger WHERE n >= $1", 11) == 2
        assert await tx.execute("SELECT n FROM it_ctx_ledger") == 0  # changes nothing


async def test_sqlite_refuses_its_own_placeholder_styles(tmp_path: Path) -> None:
    async with store_for(f"sqlite:///{tmp_path / 'style.db'}") as store:
        async with store.transaction() as tx:
            await tx.execute(LEDGER)
            for sql in (
                "INSERT INTO it_ctx_ledger VALUES (?, ?)",
                "INSERT INTO it_ctx_ledger VALUES (:n, :note)",
                "INSERT INTO it_ctx_ledger VALUES (@n, $note)",
            ):
                with pytest.raises(ConfigurationError, match=r"use \$1, \$2, \.\.\."):
                    await tx.execute(sql, 1, "x")
        assert await _rows(store) == []


class _Levels(Projection, name="it_ctx_levels"):
    """A SQL projection whose parameters are out of order: each must bind by its number."""

    async def reset(self, tx: Any) -> None:
        await tx.execute("DELETE FROM it_ctx_levels")

    @on(CtxBooked)
    async def _booked(self, e: CtxBooked, ctx: ProjectionContext) -> None:
        await ctx.transaction().execute(
            "INSERT INTO it_ctx_levels (n, label) VALUES ($2, $1)", f"n={e.n}", e.n
        )


async def test_a_projection_runs_numbered_parameters_on_every_sql_store(
    store: Store, broker_url: str, waiter: Wait
) -> None:
    async with store_for(store.url) as setup:
        async with setup.transaction() as tx:
            await tx.execute("CREATE TABLE it_ctx_levels (n INTEGER, label TEXT)")
        for n in (1, 2):
            await setup.append(f"levels-{n}", [CtxBooked(n=n)])

    async def levels() -> list[tuple[Any, ...]]:
        async with store.transaction() as tx:
            return sorted(await tx.fetch("SELECT n, label FROM it_ctx_levels"))

    app = App("it-ctx-proj", broker=broker_url, store=store, projections=[_Levels()])
    async with app:
        await waiter(lambda: _count(levels, 2), timeout=BOUND, what="both events projected")
        assert await levels() == [(1, "n=1"), (2, "n=2")]


async def _count(rows: Callable[[], Awaitable[list[Any]]], n: int) -> bool:
    return len(await rows()) >= n


async def test_a_handler_transaction_opened_in_a_child_task_commits_its_dedup_entry_with_it(
    store: Store, broker_url: str, waiter: Wait
) -> None:
    """The first ``ctx.transaction()`` may be opened by a task the handler started: the
    consumer writes the dedup entry and the outbox rows into that transaction anyway (they
    are given it), so all of it commits together, and nothing waits for itself."""
    attempts: list[int] = []

    async def book_in_child(ctx: Context, n: int) -> None:
        async with ctx.transaction() as tx:
            await tx.execute(INSERT, n, "child")
        await ctx.publish(CtxBooked(n=n))

    @subscribe(
        "it.ctx.deposit", group="ledger", retry=RetryPolicy(2, initial_delay=0.01), timeout=5.0
    )
    async def book(event: CtxDeposit, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        await asyncio.gather(book_in_child(ctx, event.n))
        if ctx.attempt == 1:
            raise RuntimeError(
                "after the writes: the row, the dedup entry and the outbox roll back"
            )

    app = App("it-ctx-child", broker=broker_url, store=store, handlers=[book])
    async with app:
        async with store.transaction() as tx:
            await tx.execute(LEDGER)
        env = await app.publish(CtxDeposit(n=7), key="7")
        await waiter(
            lambda: app.stats()["ledger:it.ctx.deposit"]["handled"] == 1,
            timeout=BOUND,
            what="the deposit handled at its second attempt",
        )
        assert attempts == [1, 2]
        assert await _rows(store) == [(7, "child")]
        assert await store.dedup.seen("ledger", env.id)
        await app.publish(env)  # a copy: the committed dedup entry drops it
        await waiter(lambda: app.stats()["ledger:it.ctx.deposit"]["duplicates"] == 1)
        assert await _rows(store) == [(7, "child")]


async def test_a_copy_recorded_elsewhere_before_the_commit_rolls_the_handling_back(
    store: Store, broker_url: str, waiter: Wait
) -> None:
    """Another instance records the message's dedup entry while the handler runs (its copy
    committed first): the handler's transaction rolls back with its writes and outgoing
    messages, and the message is acked as a duplicate, not given back. On SQLite the
    duplicate is found at the commit (its writes travel with it), on PostgreSQL at the
    dedup insert. The positive control: the next message, undisturbed, commits."""
    booked: list[int] = []
    other = store_for(store.url)  # type: ignore[attr-defined]

    @subscribe("it.ctx.deposit", group="ledger")
    async def book(event: CtxDeposit, ctx: Context) -> None:
        if event.n == 1:  # the other instance's copy commits first
            async with other.transaction() as tx:
                await other.mark_handled("ledger", ctx.envelope.id, tx)
        async with ctx.transaction() as tx:
            await tx.execute(INSERT, event.n, "handled")
            await ctx.publish(CtxBooked(n=event.n))

    @subscribe("it.ctx.booked", group="books")
    async def count(event: CtxBooked) -> None:
        booked.append(event.n)

    app = App("it-ctx-copy", broker=broker_url, store=store, handlers=[book, count])
    await other.open()
    try:
        async with app:
            async with store.transaction() as tx:
                await tx.execute(LEDGER)
            await app.publish(CtxDeposit(n=1), key="k")
            await app.publish(CtxDeposit(n=2), key="k")
            await waiter(lambda: booked == [2], timeout=BOUND, what="the second booking")
            stats = app.stats()["ledger:it.ctx.deposit"]
            assert (stats["duplicates"], stats["handled"], stats["given_back"]) == (1, 1, 0)
            assert await _rows(store) == [(2, "handled")]
    finally:
        await other.close()


@pytest.mark.service("postgres")
async def test_a_failed_commit_of_a_child_task_transaction_keeps_its_message(
    broker_url: str, waiter: Wait
) -> None:
    """On PostgreSQL the dedup entry of a transaction opened in a child task commits with
    it: when that COMMIT fails (a deferred constraint), the message is not taken as handled
    and comes back, instead of being dropped with its effects rolled back."""
    calls: list[int] = []

    async def book_in_child(ctx: Context, n: int) -> None:
        async with ctx.transaction() as tx:
            await tx.execute("INSERT INTO it_ctx_once (n) VALUES ($1)", n)

    @subscribe("it.ctx.deposit", group="ledger", timeout=5.0)
    async def book(event: CtxDeposit, ctx: Context) -> None:
        calls.append(event.n)
        await asyncio.gather(book_in_child(ctx, event.n))

    async with isolated_schema(postgres_url()) as url:
        app = App("it-ctx-commit", broker=broker_url, store=url, handlers=[book])
        async with app:
            async with app.store.transaction() as tx:
                await tx.execute(
                    "CREATE TABLE it_ctx_once (n INTEGER UNIQUE DEFERRABLE INITIALLY DEFERRED)"
                )
                await tx.execute("INSERT INTO it_ctx_once (n) VALUES (7)")  # the COMMIT fails
            env = await app.publish(CtxDeposit(n=7), key="7")
            await waiter(lambda: len(calls) >= 1, timeout=BOUND)
            await waiter(lambda: app.stats()["ledger:it.ctx.deposit"]["given_back"] >= 1)
            async with app.store.transaction() as tx:
                await tx.execute("DELETE FROM it_ctx_once")  # the next attempt can commit
            await waiter(
                lambda: app.stats()["ledger:it.ctx.deposit"]["handled"] == 1,
                timeout=BOUND,
                what="handled once its commit went through",
            )
            async with app.store.transaction() as tx:
                assert await tx.fetch("SELECT n FROM it_ctx_once") == [(7,)]
            assert await app.store.dedup.seen("ledger", env.id)


@pytest.mark.service("postgres")
async def test_a_cancellation_stays_one_when_the_rollback_fails_on_a_dead_connection() -> None:
    """A task cancelled inside a PostgreSQL transaction whose connection died (a failover, a
    partition) ends cancelled: the failed ROLLBACK is logged, not raised in its place (a
    stopping projection runner would take it for a failed batch and go on)."""
    async with isolated_schema(postgres_url()) as url:
        store = store_for(url)
        await store.open()
        try:
            admin = await asyncpg.connect(postgres_url())
            in_block = asyncio.Event()

            async def body() -> None:
                async with store.transaction() as tx:
                    [(pid,)] = await tx.fetch("SELECT pg_backend_pid()")
                    await admin.execute("SELECT pg_terminate_backend($1)", pid)
                    in_block.set()
                    await asyncio.sleep(30)  # cancelled here

            task = asyncio.create_task(body())
            await asyncio.wait_for(in_block.wait(), BOUND)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, BOUND)
            await admin.close()
            assert await store.stream_version("any") == 0  # the store still works
        finally:
            await store.close()


@pytest.mark.service("postgres")
async def test_a_write_waiting_for_a_transaction_that_ends_is_not_made_on_its_own() -> None:
    """A store write given ``tx=`` waits for the transaction's connection (another task of
    it runs a statement) while the block fails: it raises, and nothing of it commits (it
    fell back to a pooled connection and committed after the rollback)."""
    async with isolated_schema(postgres_url()) as url:
        store = store_for(url)
        await store.open()
        try:
            env = to_envelope(CtxBooked(n=1), source="t")
            busy = asyncio.Event()
            tasks: list[asyncio.Task[Any]] = []

            class Boom(Exception):
                pass

            with pytest.raises(Boom):
                async with store.transaction() as tx:

                    async def slow() -> None:
                        busy.set()
                        await tx.execute("SELECT pg_sleep(0.5)")

                    async def late() -> None:
                        await asyncio.sleep(0.1)  # queued behind slow()'s statement
                        await store.outbox.add([("it.ctx.booked", env)], tx=tx)

                    tasks.append(asyncio.create_task(slow()))
                    await busy.wait()
                    tasks.append(asyncio.create_task(late()))
                    raise Boom  # the ROLLBACK waits for slow()'s statement
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            assert isinstance(outcomes[1], StoreError)
            assert "has ended" in str(outcomes[1])
            assert await store.outbox.pending() == []
        finally:
            await store.close()
