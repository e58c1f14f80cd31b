"""A saga transition's table writes and commands ride on its stream's append
(``SagaTables.append``): on every store, a conflicting append writes no index row, no
timer row and no outbox row, and a successful one writes them all, atomically with the
events; on PostgreSQL in the append's own statement."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from eventflow import ConcurrencyError
from eventflow.adapters.memory import MemoryStore
from eventflow.envelope import Envelope
from eventflow.ports import Store
from eventflow.sagas.tables import IndexRow, NewTimer, SagaTables, Writes, tables_for
from eventflow.stores import open_store

STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.service("postgres")),
]
SAGA = "saga-order-a"


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | Store:
    kind: str = request.param
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'riding.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
async def store(store_url: str | Store) -> AsyncIterator[Store]:
    async with open_store(store_url) as opened:
        yield opened


async def _tables(store: Store) -> SagaTables:
    tables = tables_for(store)
    await tables.setup()
    return tables


def _writes(status: str, timer: str, token: str, *, cancelled: tuple[str, ...] = ()) -> Writes:
    at = datetime.fromtimestamp(1.0, UTC)
    row = IndexRow(SAGA, "order", "a", status, at, at)
    return Writes(row, [NewTimer(timer, 30.0, token)], cancelled, index=True)


def _event(name: str) -> Envelope:
    return Envelope.create("it.riding.transition", {"name": name}, source="test", key="a")


def _command(name: str) -> tuple[str, Envelope]:
    return "it.riding.command", Envelope.create("it.riding.command", {"n": name}, source="t")


async def _state(store: Store, tables: SagaTables) -> dict[str, Any]:
    rows, _ = await tables.earliest("order", 10)
    found = await tables.find(SAGA)
    return {
        "events": [r.envelope.data["name"] async for r in store.read_stream(SAGA)],
        "status": found.status if found is not None else None,
        "timers": [(r.timer, r.token) for r in rows],
        "outbox": [m.message_id for m in await store.outbox.pending()],
    }


async def test_a_conflicting_append_writes_no_table_row_and_no_command(store: Store) -> None:
    tables = await _tables(store)
    first = _command("first")
    async with store.transaction() as tx:
        version = await tables.append(
            tx, SAGA, [_event("started")], 0, _writes("running", "step:", "1:s"), [first]
        )
    assert version == 1
    # A second writer that guessed the saga was new: its append conflicts; the handling
    # goes on in the same transaction (as a saga handling does, reading the saga again),
    # and what the conflicting try would have written is not there.
    async with store.transaction() as tx:
        with pytest.raises(ConcurrencyError):
            await tables.append(
                tx,
                SAGA,
                [_event("again"), _event("again-2")],
                0,
                _writes("compensating", "step:undo", "2:u", cancelled=("step:",)),
                [_command("second")],
            )
        await tables.append(tx, SAGA, [_event("replied")], 1, _writes("running", "t", "3:t"))
    assert await _state(store, tables) == {
        "events": ["started", "replied"],
        "status": "running",
        "timers": [("step:", "1:s"), ("t", "3:t")],
        "outbox": [first[1].id],
    }


async def test_a_successful_append_writes_events_rows_and_commands_together(
    store: Store,
) -> None:
    tables = await _tables(store)
    sends = [_command("reserve"), _command("notify")]
    with pytest.raises(RuntimeError, match="roll back"):
        async with store.transaction() as tx:
            await tables.append(
                tx, SAGA, [_event("started")], 0, _writes("running", "step:", "1:s"), sends
            )
            raise RuntimeError("roll back")
    empty = {"events": [], "status": None, "timers": [], "outbox": []}
    assert await _state(store, tables) == empty
    async with store.transaction() as tx:
        await tables.append(
            tx, SAGA, [_event("started")], 0, _writes("running", "step:", "1:s"), sends
        )
    assert await _state(store, tables) == {
        "events": ["started"],
        "status": "running",
        "timers": [("step:", "1:s")],
        "outbox": [m.id for _, m in sends],  # in order
    }
    # The next transition moves the timer and changes the status in the same go.
    async with store.transaction() as tx:
        await tables.append(
            tx,
            SAGA,
            [_event("timed-out"), _event("compensating")],
            1,
            _writes("compensating", "step:undo", "2:u", cancelled=("step:",)),
        )
    state = await _state(store, tables)
    assert (state["status"], state["timers"]) == ("compensating", [("step:undo", "2:u")])
    assert state["events"] == ["started", "timed-out", "compensating"]
