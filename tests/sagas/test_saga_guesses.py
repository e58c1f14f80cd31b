"""The first try of a saga input guesses instead of reading (the saga as this process last
committed it; no saga for a start event). A wrong guess must never win: another process
changed the saga meanwhile, a transaction rolled back, a second start came, a start found
kept inputs. Two ``Sagas`` on one store stand for two processes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from eventflow.envelope import Envelope
from eventflow.events import Event, EventRegistry, envelope_for
from eventflow.ports import Store
from eventflow.sagas.runtime import Sagas
from eventflow.stores import open_store

from .shop import OrderCancelled, OrderPlaced, OrderSaga, PaymentCharged, StockReserved

STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.service("postgres")),
]


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    kind: str = request.param
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'guesses.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    async with open_store(store_url) as opened:
        yield opened


def _process(store: Store) -> Sagas:
    return Sagas(store, EventRegistry(), "guesses")


async def _apply(sagas: Sagas, event: Event, *, fail: bool = False) -> Envelope:
    """Handle ``event`` as the runtime's handler does: in a transaction, the saga joining the
    recent ones after the commit; ``fail``: the handling fails after the save (rolled back)."""
    env = Envelope.from_bytes(envelope_for(event, source="test", key="o-1").to_bytes())
    await sagas.persistence.setup()
    hooks: list[Callable[[], None]] = []
    with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
        async with sagas._store.transaction() as tx:
            machine = await sagas.handling.message(
                tx, OrderSaga, event, env, after_commit=hooks.append
            )
            assert machine is not None
            if fail:
                raise RuntimeError("the handling fails after the save")
    if not fail:
        for hook in hooks:
            hook()
    return env


async def _kinds(sagas: Sagas) -> list[str]:
    return [t.kind for t in await sagas.history(OrderSaga.definition.stream_prefix + "o-1")]


async def test_an_input_another_process_applied_first_is_not_lost(store: Store) -> None:
    one, two = _process(store), _process(store)
    await _apply(one, OrderPlaced(order_id="o-1"))  # one remembers the saga waiting on reserve
    await _apply(two, StockReserved(order_id="o-1"))  # two reads it, moves it on to charge
    await _apply(one, PaymentCharged(order_id="o-1", charge_id="ch-1"))  # one's guess is old
    saga = await one.get(OrderSaga, "o-1")
    assert saga is not None
    assert saga.charge_id == "ch-1"
    assert one.conflicts == 1  # its guess conflicted, then it read the store
    kinds = await _kinds(one)
    assert kinds.count("replied") == 2 and "ignored" not in kinds
    assert (await one.find(OrderSaga.definition.stream_prefix + "o-1")) is not None


async def test_a_handling_that_rolled_back_is_not_remembered(store: Store) -> None:
    one = _process(store)
    await _apply(one, OrderPlaced(order_id="o-1"))
    await _apply(one, StockReserved(order_id="o-1"), fail=True)
    await _apply(one, StockReserved(order_id="o-1"))  # a redelivery: applied once, for real
    saga = await one.get(OrderSaga, "o-1")
    assert saga is not None
    kinds = [t.kind for t in saga.history]
    assert kinds.count("replied") == 1 and "ignored" not in kinds
    assert one.conflicts == 0  # the guess was what committed


async def test_a_start_for_a_saga_that_exists_starts_nothing_without_a_guess(
    store: Store,
) -> None:
    one, two = _process(store), _process(store)
    await _apply(one, OrderPlaced(order_id="o-1"))
    await _apply(two, OrderPlaced(order_id="o-1", qty=5))  # two guesses "new": wrong
    saga = await two.get(OrderSaga, "o-1")
    assert saga is not None and saga.qty == 1
    assert (await _kinds(two)).count("started") == 1
    assert two.conflicts == 0  # a start that guessed "new" wrongly is no conflict


async def test_a_start_after_kept_inputs_applies_them(store: Store) -> None:
    one = _process(store)
    await _apply(one, OrderCancelled(order_id="o-1"))  # before the start: kept (pending)
    row = await one.find(OrderSaga.definition.stream_prefix + "o-1")
    assert row is not None and row.status == "pending"
    await _apply(_process(store), OrderPlaced(order_id="o-1"))  # guesses "new": wrong
    saga = await one.get(OrderSaga, "o-1")
    assert saga is not None and saga.status == "compensated"
    row = await one.find(OrderSaga.definition.stream_prefix + "o-1")
    assert row is not None and row.status == "compensated"  # the index follows the status
