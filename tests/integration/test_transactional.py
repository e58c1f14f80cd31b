"""ctx.transaction(): the handler's writes, the dedup entry and the outgoing messages commit
together (transactional inbox + outbox), on the SQL stores; and the event relay."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from eventflow import App, Context, Envelope, Event, RetryPolicy, subscribe
from eventflow.ports import Store
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url

Wait = Callable[..., Awaitable[None]]


class TxDeposit(Event, type="it.tx.deposit"):
    """Money in."""

    account: str
    amount: int


class TxDeposited(Event, type="it.tx.deposited"):
    """Money booked."""

    account: str
    amount: int


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        yield store_for(f"sqlite:///{tmp_path / 'tx.db'}")
        return
    async with isolated_schema(postgres_url()) as url:
        yield store_for(url)


def _sql(store: Store) -> tuple[str, str, str]:
    """(create table, insert, count) statements: the same SQL on every store."""
    return (
        "CREATE TABLE IF NOT EXISTS it_ledger (account TEXT, amount INTEGER)",
        "INSERT INTO it_ledger (account, amount) VALUES ($1, $2)",
        "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM it_ledger",
    )


async def _ledger(store: Store) -> tuple[int, int]:
    async with store.transaction() as tx:
        rows = await tx.fetch(_sql(store)[2])
    return int(rows[0][0]), int(rows[0][1])


async def test_effects_dedup_and_outbox_commit_together(
    store: Store, broker_url: str, waiter: Wait
) -> None:
    create, insert, _ = _sql(store)
    booked: list[TxDeposited] = []
    fail_first = {"n": 0}

    @subscribe("it.tx.deposit", group="ledger", retry=RetryPolicy(3, initial_delay=0.01))
    async def book(event: TxDeposit, ctx: Context) -> None:
        async with ctx.transaction() as tx:
            await tx.execute(insert, event.account, event.amount)
            await ctx.publish(TxDeposited(account=event.account, amount=event.amount))
        if event.amount == 7 and fail_first["n"] == 0:
            fail_first["n"] += 1
            raise RuntimeError("after the insert: the whole attempt must roll back")

    @subscribe("it.tx.deposited", group="notify")
    async def notify(event: TxDeposited) -> None:
        booked.append(event)

    app = App("it-tx", broker=broker_url, store=store, handlers=[book, notify])
    async with app:
        async with store.transaction() as tx:
            await tx.execute(create)
        first = await app.publish(TxDeposit(account="a", amount=5), key="a")
        await app.publish(TxDeposit(account="a", amount=7), key="a")
        await app.publish(first)  # a duplicate: must not book twice
        # A last deposit of the same key: handled, booked and relayed after everything
        # before it (one key, in order), so a booking of the duplicate or of the failed
        # attempt would have been relayed before this one's.
        await app.publish(TxDeposit(account="a", amount=100), key="a")
        await waiter(lambda: any(e.amount == 100 for e in booked), what="the last booking")
        assert await _ledger(store) == (3, 112)
        assert [e.amount for e in booked] == [5, 7, 100]
        assert fail_first["n"] == 1

        async def relayed() -> bool:
            return await store.outbox.pending() == []

        # The relay removes a row after sending it, so the last booking can arrive first.
        await waiter(relayed, what="the outbox relayed and removed")
        assert await store.outbox.pending() == []
        assert await store.dedup.seen("ledger", first.id)


async def test_a_failed_attempt_leaves_nothing(store: Store, broker_url: str, waiter: Wait) -> None:
    create, insert, _ = _sql(store)

    @subscribe("it.tx.deposit", group="ledger", retry=RetryPolicy(2, initial_delay=0.01))
    async def book(event: TxDeposit, ctx: Context) -> None:
        async with ctx.transaction() as tx:
            await tx.execute(insert, event.account, event.amount)
            await ctx.publish(TxDeposited(account=event.account, amount=event.amount))
        raise RuntimeError("always fails")

    app = App("it-tx-fail", broker=broker_url, store=store, handlers=[book])
    async with app:
        async with store.transaction() as tx:
            await tx.execute(create)
        env = await app.publish(TxDeposit(account="b", amount=1), key="b")
        await waiter(
            lambda: app.stats()["ledger:it.tx.deposit"]["dead_lettered"] == 1, what="the DLQ"
        )
        assert await _ledger(store) == (0, 0)
        assert await store.outbox.pending() == []
        assert not await store.dedup.seen("ledger", env.id)


async def test_event_relay_publishes_appended_events_in_stream_order(
    broker_url: str, waiter: Wait, tmp_path: Path
) -> None:
    got: list[Envelope] = []

    @subscribe("it.tx.>", group="audit")
    async def audit(env: Envelope) -> None:
        got.append(env)

    store = store_for(f"sqlite:///{tmp_path / 'relay.db'}")
    app = App("it-relay", broker=broker_url, store=store, handlers=[audit], relay_events=True)
    async with app:
        for n in range(1, 6):
            await store.append("acct-1", [TxDeposit(account="1", amount=n)])
            await store.append("acct-2", [TxDeposit(account="2", amount=n)])
        await waiter(lambda: len(got) == 10, what="the relayed events")
        by_stream: dict[str | None, list[Any]] = {}
        for env in got:
            by_stream.setdefault(env.key, []).append(env.data["amount"])
        assert by_stream == {"acct-1": [1, 2, 3, 4, 5], "acct-2": [1, 2, 3, 4, 5]}
    # The relay's checkpoint survives: a restarted app relays nothing twice.
    got.clear()
    # One partition: the relay publishes in store order, so an event relayed twice would
    # arrive before the new one.
    one_partition = f"{broker_url}?partitions=1"
    app2 = App("it-relay", broker=one_partition, store=store, handlers=[audit], relay_events=True)
    async with app2:
        await store.append("acct-3", [TxDeposit(account="3", amount=1)])
        await waiter(lambda: any(e.key == "acct-3" for e in got), what="the new event")
        assert [e.key for e in got] == ["acct-3"]
        assert app2.stats()["audit:it.tx.>"]["received"] == 1  # none skipped as a duplicate


async def test_a_failed_transaction_block_rolls_back_even_if_the_handler_swallows_it(
    store: Store, broker_url: str, waiter: Wait
) -> None:
    create, insert, _ = _sql(store)
    attempts: list[int] = []

    @subscribe("it.tx.deposit", group="ledger", retry=RetryPolicy(2, initial_delay=0.01))
    async def book(event: TxDeposit, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        try:
            async with ctx.transaction() as tx:
                await tx.execute(insert, event.account, event.amount)
                raise ValueError("half-way")
        except ValueError:
            pass  # swallowed: the partial write must still not commit

    app = App("it-tx-swallow", broker=broker_url, store=store, handlers=[book])
    async with app:
        async with store.transaction() as tx:
            await tx.execute(create)
        await app.publish(TxDeposit(account="c", amount=3), key="c")
        await waiter(lambda: app.stats()["ledger:it.tx.deposit"]["dead_lettered"] == 1)
        assert attempts == [1, 2]
        assert await _ledger(store) == (0, 0)
        [letter] = await app.dead_letters.list()
        assert "ctx.transaction()" in letter.error and "rolled back" in letter.error
