"""The memory store's transactions beyond the store contract: what only one process can
show (deadlocks between two transactions, a transaction's own context), and the writes
that join the context's transaction."""

from __future__ import annotations

import asyncio

import pytest

from eventflow.adapters.memory import MemoryStore
from eventflow.errors import LeaseLostError, StoreError
from eventflow.testing.store_contract import happened, read_stream


class Boom(Exception):
    pass


async def test_two_transactions_waiting_for_each_others_stream_are_a_deadlock() -> None:
    """A holds x and waits for y, held by B; B then asks for x: B is refused at once (a
    deadlock), its block rolls back, and A goes on and commits both of its appends."""
    store = MemoryStore()
    a_holds, b_holds = asyncio.Event(), asyncio.Event()

    async def a() -> None:
        async with store.transaction():
            await store.append("x", happened(1, note="a"))
            a_holds.set()
            await b_holds.wait()
            await store.append("y", happened(1, note="a"))  # waits for B

    async def b() -> None:
        async with store.transaction():
            await store.append("y", happened(1, note="b"))
            b_holds.set()
            await a_holds.wait()
            await asyncio.sleep(0.01)  # A is waiting for y by now
            await store.append("x", happened(1, note="b"))

    async with asyncio.timeout(5):
        results = await asyncio.gather(a(), b(), return_exceptions=True)
    assert results[0] is None
    assert isinstance(results[1], StoreError) and "deadlock" in str(results[1])
    assert [r.envelope.data["note"] for r in await read_stream(store, "x")] == ["a"]
    assert [r.envelope.data["note"] for r in await read_stream(store, "y")] == ["a"]


async def test_a_transaction_cannot_be_nested_in_its_context() -> None:
    """As on the SQL stores: a second ``transaction()`` in the same context is refused."""
    store = MemoryStore()
    async with store.transaction():
        with pytest.raises(StoreError, match="already open"):
            async with store.transaction():
                pass


async def test_a_task_that_outlives_the_block_writes_on_its_own() -> None:
    """A task created inside the block joins the transaction while it is open; once the
    block ended, its appends commit on their own (and writes through the ended
    transaction are refused)."""
    store = MemoryStore()
    go = asyncio.Event()

    async def late() -> None:
        await go.wait()
        await store.append("late", happened(1))

    async with store.transaction() as tx:
        task = asyncio.create_task(late())
    go.set()
    await task
    assert await store.stream_version("late") == 1
    with pytest.raises(StoreError, match="has ended"):
        tx.defer(lambda: None)


async def test_writes_without_tx_join_the_contexts_transaction() -> None:
    """Checkpoints and outbox adds made without ``tx=`` inside the block commit with it, as
    the SQL stores' do."""
    store = MemoryStore()
    with pytest.raises(Boom):
        async with store.transaction():
            await store.checkpoints.set("cp", 3)
            await store.append("s", happened(1))
            raise Boom
    assert await store.checkpoints.get("cp") == 0
    async with store.transaction():
        await store.checkpoints.set("cp", 4)
        assert await store.checkpoints.get("cp") == 0  # applied at commit
    assert await store.checkpoints.get("cp") == 4


async def test_a_fenced_transaction_is_refused_at_commit_if_the_lease_changed_hands() -> None:
    """The memory fence is checked again at commit: a lease released and taken by another
    holding while the fenced transaction is open refuses its commit, and nothing of it is
    written."""
    store = MemoryStore()
    with pytest.raises(LeaseLostError):
        async with store.transaction() as tx:
            async with store.leases.hold("n") as lease:
                await store.leases.fence(lease, tx)
                await store.append("s", happened(1))
            async with store.leases.hold("n"):
                pass
    assert await store.stream_version("s") == 0


async def test_the_clock_can_be_replaced() -> None:
    """``store.clock`` reads the host's clock unless given another source (a test kit's
    virtual clock); it has no SQL."""
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    assert await store.clock.now() == 1000.0
    now[0] = 1002.5
    assert await store.clock.now() == 1002.5
    store.clock.source = lambda: 7.0
    async with store.transaction() as tx:
        assert await store.clock.now(tx) == 7.0
    assert store.clock.sql is None
