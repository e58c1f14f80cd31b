"""Snapshots: written every N events, loaded instead of a full replay, identical state,
stale ones ignored."""

from __future__ import annotations

import enum
import logging
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from pydantic import BaseModel

from eventflow import Event
from eventflow.adapters.memory import MemoryStore
from eventflow.ports import Snapshot, Store
from eventflow.sourcing import Aggregate, Repository, on
from eventflow.sourcing.snapshots import restore_snapshot, schema_marker, take_snapshot

from .domain import Cart, ItemAdded


class Tick(Event, type="agg.ledger.tick"):
    """One step of the ledger: every field type the snapshot must round-trip."""

    n: int


class Colour(enum.Enum):
    """An enum field."""

    RED = "red"
    BLUE = "blue"


class Entry(BaseModel):
    """A nested model."""

    at: datetime
    amount: Decimal
    tags: list[str] = []


class Ledger(Aggregate):
    """State of many kinds, all changed by each tick."""

    count: int = 0
    ratio: float = 0.0
    name: str = ""
    opened: datetime | None = None
    day: date | None = None
    token: uuid.UUID | None = None
    colour: Colour = Colour.RED
    seen: set[str] = set()
    pair: tuple[int, str] = (0, "")
    by_id: dict[int, str] = {}
    entries: list[Entry] = []
    latest: Entry | None = None
    nested: dict[str, list[dict[str, int]]] = {}

    @on(Tick)
    def _tick(self, e: Tick) -> None:
        n = e.n
        self.count += 1
        self.ratio = n / 7
        self.name = f"ledger-é-{n}"
        at = datetime(2024, 1, 1, tzinfo=timezone(timedelta(hours=5, minutes=30)))
        at += timedelta(microseconds=n * 1001)
        self.opened = self.opened or at
        self.day = date(2024, 1, 1) + timedelta(days=n)
        self.token = uuid.UUID(int=n)
        self.colour = Colour.BLUE if n % 2 else Colour.RED
        self.seen.add(f"s{n % 5}")
        self.pair = (n, str(n))
        self.by_id[n % 4] = f"v{n}"
        entry = Entry(at=at.astimezone(UTC), amount=Decimal(n) / 3, tags=[str(n)] * (n % 3))
        self.entries.append(entry)
        self.latest = entry
        self.nested.setdefault(str(n % 3), []).append({"n": n})


async def _ticks(repo: Repository[Ledger], count: int, batch: int = 1) -> None:
    ledger = await repo.get_or_create("l-1")
    for n in range(1, count + 1):
        ledger.record(Tick(n=n))
        if n % batch == 0 or n == count:
            await repo.save(ledger)


async def test_snapshot_state_is_identical_to_a_full_replay(store: Store) -> None:
    repo = Repository(Ledger, store, snapshot_every=5)
    await _ticks(repo, 12, batch=3)  # crosses 5 at v6 and 10 at v12
    snapshot = await store.load_snapshot("ledger-l-1")
    assert snapshot is not None and snapshot.version == 12

    from_snapshot = await repo.load("l-1")
    replayed = await Repository(Ledger, store).load("l-1")  # no snapshots: full replay
    assert from_snapshot == replayed
    assert from_snapshot.model_dump() == replayed.model_dump()
    assert from_snapshot.version == replayed.version == 12
    assert isinstance(from_snapshot.entries[0].amount, Decimal)
    assert from_snapshot.by_id == {1: "v9", 2: "v10", 3: "v11", 0: "v12"}
    assert from_snapshot.opened is not None and from_snapshot.opened.utcoffset() == timedelta(
        hours=5, minutes=30
    )


async def test_load_applies_the_events_after_the_snapshot(store: Store) -> None:
    repo = Repository(Ledger, store, snapshot_every=10)
    await _ticks(repo, 13)
    snapshot = await store.load_snapshot("ledger-l-1")
    assert snapshot is not None and snapshot.version == 10
    loaded = await repo.load("l-1")
    assert loaded.version == 13
    assert loaded == await Repository(Ledger, store).load("l-1")


async def test_a_snapshot_is_written_when_a_save_crosses_a_multiple(store: Store) -> None:
    repo = Repository(Cart, store, snapshot_every=3)
    cart = Cart(id="c")
    cart.add("a", 1)
    cart.add("b", 1)
    await repo.save(cart)
    assert await store.load_snapshot("cart-c") is None
    for sku in "cdefg":  # saves at versions 3..7 in one batch: crosses 3 and 6
        cart.add(sku, 1)
    await repo.save(cart)
    snapshot = await store.load_snapshot("cart-c")
    assert snapshot is not None and snapshot.version == 7
    assert dict(snapshot.state["data"]["items"]) == dict.fromkeys("abcdefg", 1)


async def test_load_starts_from_the_snapshot(store: Store) -> None:
    repo = Repository(Cart, store, snapshot_every=2)
    cart = Cart(id="c")
    cart.add("a", 1)
    cart.add("b", 1)
    await repo.save(cart)
    # Proof that the snapshot is used: a (valid) doctored one shows through.
    doctored = take_snapshot("cart-c", cart.model_copy(update={"items": {"from-snapshot": 9}}))
    await store.save_snapshot(doctored)
    assert (await repo.load("c")).items == {"from-snapshot": 9}
    # Without snapshot_every, snapshots are not read.
    assert (await Repository(Cart, store).load("c")).items == {"a": 1, "b": 1}


async def test_a_snapshot_of_another_state_shape_is_ignored(store: Store) -> None:
    repo = Repository(Cart, store, snapshot_every=1)
    cart = Cart(id="c")
    cart.add("a", 1)
    await repo.save(cart)

    class CartV2(Aggregate, stream="cart"):
        """The same stream, with a new field: the old snapshot must not be used."""

        items: dict[str, int] = {}
        checked_out: bool = False
        notes: list[str] = []

        @on(ItemAdded)
        def _added(self, e: ItemAdded) -> None:
            self.items[e.sku] = self.items.get(e.sku, 0) + 2 * e.qty

    assert schema_marker(CartV2) != schema_marker(Cart)
    loaded = await Repository(CartV2, store, snapshot_every=1).load("c")
    assert loaded.items == {"a": 2}  # replayed with the new applier


async def test_snapshot_version_invalidates_snapshots_of_the_same_shape(store: Store) -> None:
    await Repository(Cart, store, snapshot_every=1).create(_with_item(Cart(id="c")))

    class Bumped(Cart, stream="cart", snapshot_version=2):
        @on(ItemAdded)
        def _added(self, e: ItemAdded) -> None:
            self.items[e.sku] = 100

    assert schema_marker(Bumped).startswith("v2:")
    assert schema_marker(Bumped).split(":")[1] == schema_marker(Cart).split(":")[1]
    assert (await Repository(Bumped, store, snapshot_every=1).load("c")).items == {"a": 100}


def test_docstrings_and_titles_do_not_change_the_marker() -> None:
    class A1(Aggregate):
        """One docstring."""

        title: str = ""

    class A2(Aggregate):
        """Another docstring."""

        title: str = ""

    class A3(Aggregate):
        title: int = 0

    assert schema_marker(A1) == schema_marker(A2) != schema_marker(A3)


def test_a_snapshot_that_does_not_validate_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    state = {"format": 1, "schema": schema_marker(Cart), "data": {"items": "not a dict"}}
    snapshot = Snapshot("cart-c", 3, state, datetime.now(UTC))
    with caplog.at_level(logging.WARNING, logger="eventflow.sourcing"):
        assert restore_snapshot(Cart, "c", snapshot) is None
    assert "does not validate" in caplog.text
    good = Snapshot("cart-c", 3, {**state, "data": {"items": {"a": 1}}}, datetime.now(UTC))
    restored = restore_snapshot(Cart, "c", good)
    assert restored is not None and (restored.id, restored.version) == ("c", 3)


class BrokenSnapshots(MemoryStore):
    """A memory store whose snapshot table is failing."""

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        raise OSError("disk full")


async def test_a_failed_snapshot_does_not_fail_the_save(caplog: pytest.LogCaptureFixture) -> None:
    store = BrokenSnapshots()
    repo = Repository(Cart, store, snapshot_every=1)
    with caplog.at_level(logging.WARNING, logger="eventflow.sourcing"):
        assert await repo.create(_with_item(Cart(id="c"))) == 1
    assert "could not store the snapshot of cart-c at v1" in caplog.text
    assert (await repo.load("c")).items == {"a": 1}


def _with_item(cart: Cart) -> Cart:
    cart.add("a", 1)
    return cart
