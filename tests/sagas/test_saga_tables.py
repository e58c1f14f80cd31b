"""The saga tables port (index, timers on the store's clock, kept inputs) on memory, SQLite
and PostgreSQL: one behaviour, two implementations."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from eventflow.adapters.memory import MemoryStore
from eventflow.ports import Store
from eventflow.sagas.tables import IndexRow, NewTimer, SagaTables, tables_for
from eventflow.stores import open_store

STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.service("postgres")),
]


class Clock:
    """A clock a test moves (the memory store's source)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | Store:
    kind: str = request.param
    if kind == "memory":
        return MemoryStore(clock=Clock())
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'tables.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
async def store(store_url: str | Store) -> AsyncIterator[Store]:
    async with open_store(store_url) as opened:
        yield opened


def _row(saga_id: str, status: str = "running", at: float = 1.0) -> IndexRow:
    when = datetime.fromtimestamp(at, UTC)
    return IndexRow(saga_id, "order", saga_id.rsplit("-", 1)[-1], status, when, when)


async def _tables(store: Store) -> SagaTables:
    tables = tables_for(store)
    await tables.setup()
    await tables.setup()  # idempotent
    return tables


async def test_timers_are_due_on_the_store_clock_and_replaced_by_name(store: Store) -> None:
    tables = await _tables(store)
    async with store.transaction() as tx:
        before = await store.clock.now(tx)
        await tables.save(
            tx,
            _row("saga-order-a"),
            [NewTimer("step:ship", 30.0, "1:step:ship"), NewTimer("t", 5.0, "1:t")],
            (),
        )
        await tables.save(tx, _row("saga-order-b"), [NewTimer("step:ship", 10.0, "1:s")], ())
    rows, now = await tables.earliest("order", 10)
    assert [(r.saga_id, r.timer) for r in rows] == [
        ("saga-order-a", "t"),
        ("saga-order-b", "step:ship"),
        ("saga-order-a", "step:ship"),
    ]
    # On the store's clock (SQLite's SQL clock counts whole milliseconds).
    assert before + 5.0 - 0.002 <= rows[0].due <= now + 5.0 + 0.002
    assert now >= before - 0.002  # ``clock.now`` is time.time(); the SQL clock is in ms
    # Set again under a new token: replaced; cancelled: gone; another class: not listed.
    async with store.transaction() as tx:
        await tables.save(tx, _row("saga-order-a"), [NewTimer("t", 50.0, "2:t")], ["step:ship"])
        other = IndexRow("saga-pay-a", "pay", "a", "running", _row("x").started, _row("x").updated)
        await tables.save(tx, other, [NewTimer("t", 0.0, "1:t")], ())
    rows, _ = await tables.earliest("order", 10)
    assert [(r.saga_id, r.timer, r.token) for r in rows] == [
        ("saga-order-b", "step:ship", "1:s"),
        ("saga-order-a", "t", "2:t"),
    ]
    assert len((await tables.earliest("order", 1))[0]) == 1


async def test_a_timer_is_dropped_only_with_its_token_and_writes_roll_back(store: Store) -> None:
    tables = await _tables(store)
    async with store.transaction() as tx:
        await tables.save(tx, _row("saga-order-a"), [NewTimer("t", 1.0, "1:t")], ())
    (fired,), _ = await tables.earliest("order", 10)
    async with store.transaction() as tx:
        await tables.save(tx, _row("saga-order-a"), [NewTimer("t", 1.0, "2:t")], ())
    async with store.transaction() as tx:
        await tables.drop_timer(tx, fired)  # an older setting: the new one stays
    assert [r.token for r in (await tables.earliest("order", 10))[0]] == ["2:t"]
    (current,), _ = await tables.earliest("order", 10)
    with pytest.raises(RuntimeError, match="roll back"):
        async with store.transaction() as tx:
            await tables.drop_timer(tx, current)
            await tables.save(tx, _row("saga-order-z"), [NewTimer("t", 1.0, "1:t")], ())
            raise RuntimeError("roll back")
    assert [r.saga_id for r in (await tables.earliest("order", 10))[0]] == ["saga-order-a"]
    assert await tables.find("saga-order-z") is None
    async with store.transaction() as tx:
        await tables.drop_timer(tx, current)
    assert (await tables.earliest("order", 10))[0] == []


async def test_the_index_lists_by_name_and_status_newest_first(store: Store) -> None:
    tables = await _tables(store)
    async with store.transaction() as tx:
        await tables.save(tx, _row("saga-order-a", at=1.0), [], ())
        await tables.save(tx, _row("saga-order-b", "failed", at=2.0), [], ())
        await tables.save(tx, _row("saga-order-c", at=3.0), [], ())
    assert [r.id for r in await tables.list()] == ["saga-order-c", "saga-order-b", "saga-order-a"]
    assert [r.id for r in await tables.list(status="failed")] == ["saga-order-b"]
    assert [r.id for r in await tables.list(name="pay")] == []
    assert [r.id for r in await tables.list(limit=1)] == ["saga-order-c"]
    async with store.transaction() as tx:
        await tables.save(tx, _row("saga-order-a", "completed", at=4.0), [], ())
    found = await tables.find("saga-order-a")
    assert found is not None and found.status == "completed"
    assert found.started == _row("x", at=1.0).started  # kept from the first write
    assert await tables.find("saga-order-x") is None


async def test_counts_per_saga_name_and_status(store: Store) -> None:
    tables = await _tables(store)
    assert await tables.counts() == {}
    async with store.transaction() as tx:
        await tables.save(tx, _row("saga-order-a"), [], ())
        await tables.save(tx, _row("saga-order-b", "failed"), [], ())
        await tables.save(tx, _row("saga-order-c"), [], ())
        pay = _row("saga-pay-d")
        await tables.save(
            tx, IndexRow(pay.id, "pay", "d", "running", pay.started, pay.updated), [], ()
        )
    assert await tables.counts() == {
        ("order", "running"): 2,
        ("order", "failed"): 1,
        ("pay", "running"): 1,
    }
    async with store.transaction() as tx:
        await tables.save(tx, _row("saga-order-b", "completed", at=2.0), [], ())
    assert (await tables.counts())[("order", "completed")] == 1
    assert ("order", "failed") not in await tables.counts()


async def test_one_save_cancels_sets_and_skips_the_index_as_asked(store: Store) -> None:
    """What one transition writes, however the store sends it (one statement on
    PostgreSQL, queued writes on SQLite): a timer both cancelled and set is set (the later
    write wins), the other cancels go, and ``index=False`` leaves the index as it was."""
    tables = await _tables(store)
    async with store.transaction() as tx:
        await tables.save(
            tx,
            _row("saga-order-a"),
            [NewTimer("step:", 30.0, "1:s"), NewTimer("t", 9.0, "1:t")],
            (),
        )
    async with store.transaction() as tx:
        await tables.save(
            tx,
            _row("saga-order-a", "compensating", at=5.0),
            [NewTimer("step:", 20.0, "2:s")],
            ["step:", "t"],
            index=False,
        )
    rows, _ = await tables.earliest("order", 10)
    assert [(r.timer, r.token) for r in rows] == [("step:", "2:s")]
    found = await tables.find("saga-order-a")
    assert found is not None and found.status == "running"
    async with store.transaction() as tx:  # nothing to write: nothing written
        await tables.save(tx, _row("saga-order-a", "failed"), [], (), index=False)
    found = await tables.find("saga-order-a")
    assert found is not None and found.status == "running"


def test_each_store_gets_its_adapters_saga_tables(tmp_path: Path) -> None:
    """``tables_for`` takes the implementation a store adapter registered for its class:
    one statement per transition on PostgreSQL, queued writes on SQLite, dicts in memory."""
    from eventflow.adapters.postgres import PostgresSagaTables, PostgresStore
    from eventflow.adapters.sqlite import SqliteSagaTables, SqliteStore
    from eventflow.sagas.tables import MemorySagaTables

    assert type(tables_for(SqliteStore(str(tmp_path / "t.db")))) is SqliteSagaTables
    pg = PostgresStore.from_url("postgresql://postgres@127.0.0.1:5432/test")
    assert type(tables_for(pg)) is PostgresSagaTables
    assert type(tables_for(MemoryStore())) is MemorySagaTables
