"""``Repository``: load, save with optimistic concurrency, create, update with retries."""

from __future__ import annotations

import pytest

from eventflow import (
    AggregateNotFound,
    ConcurrencyError,
    ConfigurationError,
    Event,
    UnknownEventTypeError,
    upcaster,
)
from eventflow.envelope import Envelope
from eventflow.events import to_envelope
from eventflow.ports import Store
from eventflow.sourcing import Aggregate, Repository, on

from .domain import Cart, CheckedOut, ItemAdded, ItemRemoved, Noted


async def _cart(repo: Repository[Cart], cart_id: str = "c-1", *skus: str) -> Cart:
    cart = Cart(id=cart_id)
    for sku in skus or ("a",):
        cart.add(sku, 1)
    await repo.create(cart)
    return cart


async def test_save_then_load_rebuilds_the_state(store: Store) -> None:
    repo = Repository(Cart, store)
    cart = Cart(id="c-1")
    cart.add("a", 2)
    cart.add("b", 1)
    cart.record(ItemRemoved(sku="b"))
    assert await repo.save(cart) == 3
    assert (cart.version, cart.saved_version, cart.pending) == (3, 3, ())

    loaded = await repo.load("c-1")
    assert loaded == cart
    assert (loaded.id, loaded.version, loaded.items) == ("c-1", 3, {"a": 2})


async def test_events_go_to_the_prefixed_stream_keyed_by_it(store: Store) -> None:
    repo = Repository(Cart, store, source="shop")
    await _cart(repo, "c-9", "a", "b")
    records = [r async for r in store.read_stream("cart-c-9")]
    assert [r.stream_version for r in records] == [1, 2]
    assert {r.envelope.key for r in records} == {"cart-c-9"}
    assert {r.envelope.source for r in records} == {"shop"}
    # one command's events share a correlation: the first event's id
    assert {r.envelope.correlation_id for r in records} == {records[0].envelope.id}


async def test_stream_prefix_overrides_the_class_keyword(store: Store) -> None:
    repo = Repository(Cart, store, stream_prefix="basket")
    await _cart(repo, "x")
    assert await store.stream_version("basket-x") == 1
    assert await store.stream_version("cart-x") == 0
    assert repo.stream_id("x") == "basket-x"


async def test_load_of_a_missing_aggregate_raises_not_found(store: Store) -> None:
    repo = Repository(Cart, store)
    with pytest.raises(AggregateNotFound, match=r"no Cart with id 'nope'.*get_or_create"):
        await repo.load("nope")
    assert await repo.exists("nope") is False


async def test_get_or_create_returns_new_or_stored(store: Store) -> None:
    repo = Repository(Cart, store)
    fresh = await repo.get_or_create("c-1")
    assert (fresh.version, fresh.items) == (0, {})
    fresh.add("a", 1)
    await repo.save(fresh)
    stored = await repo.get_or_create("c-1")
    assert (stored.version, stored.items) == (1, {"a": 1})
    assert await repo.exists("c-1") is True


async def test_saving_nothing_is_a_no_op(store: Store) -> None:
    repo = Repository(Cart, store)
    cart = await _cart(repo)
    assert await repo.save(cart) == 1
    assert await repo.save(Cart(id="empty")) == 0
    assert await store.stream_version("cart-c-1") == 1
    assert await repo.exists("empty") is False


async def test_a_stale_aggregate_cannot_be_saved(store: Store) -> None:
    repo = Repository(Cart, store)
    await _cart(repo)
    first, second = await repo.load("c-1"), await repo.load("c-1")
    first.add("b", 1)
    await repo.save(first)
    second.add("c", 1)
    with pytest.raises(ConcurrencyError) as info:
        await repo.save(second)
    assert (info.value.stream, info.value.expected, info.value.actual) == ("cart-c-1", 1, 2)
    assert second.pending  # still pending: nothing was stored
    assert (await repo.load("c-1")).items == {"a": 1, "b": 1}


async def test_create_refuses_an_existing_id_and_misuse(store: Store) -> None:
    repo = Repository(Cart, store)
    await _cart(repo)
    duplicate = Cart(id="c-1")
    duplicate.add("z", 1)
    with pytest.raises(ConcurrencyError):
        await repo.create(duplicate)
    with pytest.raises(ConfigurationError, match="at least one recorded event"):
        await repo.create(Cart(id="c-2"))
    loaded = await repo.load("c-1")
    loaded.add("b", 1)
    with pytest.raises(ConfigurationError, match="use save"):
        await repo.create(loaded)


async def test_save_refuses_another_aggregate_class(store: Store) -> None:
    class Other(Aggregate):
        pass

    repo = Repository(Cart, store)
    with pytest.raises(ConfigurationError, match="saves Cart aggregates"):
        await repo.save(Other(id="o"))  # type: ignore[arg-type]


def test_repository_arguments_are_validated(store: Store) -> None:
    with pytest.raises(ConfigurationError, match="Aggregate subclass"):
        Repository(Aggregate, store)
    with pytest.raises(ConfigurationError, match="snapshot_every"):
        Repository(Cart, store, snapshot_every=0)
    with pytest.raises(ConfigurationError, match="stream_prefix"):
        Repository(Cart, store, stream_prefix="a-b")
    with pytest.raises(ConfigurationError, match="non-empty str"):
        Repository(Cart, store).stream_id("")


async def test_update_loads_runs_the_command_and_saves(store: Store) -> None:
    repo = Repository(Cart, store)
    await _cart(repo)
    saved = await repo.update("c-1", lambda cart: cart.add("b", 4))
    assert (saved.version, saved.pending) == (2, ())
    assert (await repo.load("c-1")).items == {"a": 1, "b": 4}


async def test_update_accepts_async_commands_and_can_create(store: Store) -> None:
    repo = Repository(Cart, store)

    async def add(cart: Cart) -> None:
        cart.add("a", 1)

    with pytest.raises(AggregateNotFound):
        await repo.update("new", add)
    created = await repo.update("new", add, create=True)
    assert (created.version, created.items) == (1, {"a": 1})


async def test_update_retries_on_a_conflict_with_the_new_state(store: Store) -> None:
    repo = Repository(Cart, store)
    await _cart(repo)
    seen: list[dict[str, int]] = []

    async def command(cart: Cart) -> None:
        seen.append(dict(cart.items))
        if len(seen) == 1:  # another writer saves between our load and our save
            await repo.update("c-1", lambda other: other.add("rival", 1))
        cart.add("mine", 1)

    saved = await repo.update("c-1", command)
    assert seen == [{"a": 1}, {"a": 1, "rival": 1}]
    assert saved.version == 3
    assert (await repo.load("c-1")).items == {"a": 1, "rival": 1, "mine": 1}


async def test_update_gives_up_after_its_attempts(store: Store) -> None:
    repo = Repository(Cart, store)
    await _cart(repo)
    calls = 0

    async def always_conflicts(cart: Cart) -> None:
        nonlocal calls
        calls += 1
        await repo.update("c-1", lambda other: other.add(f"rival{calls}", 1))
        cart.add("mine", 1)

    with pytest.raises(ConcurrencyError):
        await repo.update("c-1", always_conflicts, attempts=2)
    assert calls == 2
    assert "mine" not in (await repo.load("c-1")).items
    with pytest.raises(ConfigurationError, match="attempts"):
        await repo.update("c-1", always_conflicts, attempts=0)


async def test_update_does_not_save_when_the_command_raises(store: Store) -> None:
    repo = Repository(Cart, store)
    cart = await _cart(repo)
    cart.record(CheckedOut())
    await repo.save(cart)
    with pytest.raises(ValueError, match="checked out"):
        await repo.update("c-1", lambda c: c.add("b", 1))
    assert await store.stream_version("cart-c-1") == 2


async def test_caused_by_continues_the_correlation(store: Store) -> None:
    repo = Repository(Cart, store)
    cause = to_envelope(Noted(text="command"), source="api", correlation_id="corr-1")
    cart = Cart(id="c-1")
    cart.add("a", 1)
    cart.add("b", 1)
    await repo.save(cart, caused_by=cause)
    records = [r async for r in store.read_stream("cart-c-1")]
    assert {r.envelope.correlation_id for r in records} == {"corr-1"}
    assert {r.envelope.causation_id for r in records} == {cause.id}
    trace = cause.headers["traceparent"].split("-")[1]
    assert all(r.envelope.headers["traceparent"].split("-")[1] == trace for r in records)


async def test_unknown_stream_events_fail_the_load_unless_ignored(store: Store) -> None:
    await store.append("cart-c-1", [ItemAdded(sku="a", qty=1), Noted(text="x")])
    with pytest.raises(
        UnknownEventTypeError, match=r"no @on method for event type 'agg\.cart\.noted'"
    ):
        await Repository(Cart, store).load("c-1")

    class TolerantCart(Cart, stream="cart", ignore_unknown_events=True):
        pass

    tolerant = await Repository(TolerantCart, store).load("c-1")
    assert (tolerant.version, tolerant.items) == (2, {"a": 1})


class PriceSet1(Event, type="agg.price.set", version=1):
    """Version 1: an amount in cents."""

    cents: int


class PriceSet(Event, type="agg.price.set", version=2):
    """Version 2: an amount and a currency."""

    cents: int
    currency: str


@upcaster("agg.price.set", from_version=1)
def _add_currency(data: dict[str, object]) -> dict[str, object]:
    return {**data, "currency": "EUR"}


class Product(Aggregate):
    """Applies the newest version of its price event."""

    prices: list[str] = []

    @on(PriceSet)
    def _price(self, e: PriceSet) -> None:
        self.prices.append(f"{e.cents} {e.currency}")


async def test_stored_old_versions_are_upcast_before_the_applier(store: Store) -> None:
    old = to_envelope(PriceSet1(cents=100), source="", key="product-p")
    assert old.version == 1
    await store.append("product-p", [old, PriceSet(cents=250, currency="USD")])
    product = await Repository(Product, store).load("p")
    assert product.prices == ["100 EUR", "250 USD"]


async def test_an_applier_typed_with_an_older_version_gets_that_version(store: Store) -> None:
    class LegacyProduct(Aggregate, stream="legacy_product"):
        cents: int = 0

        @on(PriceSet1)
        def _price(self, e: PriceSet1) -> None:
            assert type(e) is PriceSet1
            self.cents += e.cents

    old = [to_envelope(PriceSet1(cents=c), source="", key="legacy_product-p") for c in (3, 4)]
    await store.append("legacy_product-p", [Envelope.from_bytes(e.to_bytes()) for e in old])
    assert (await Repository(LegacyProduct, store).load("p")).cents == 7
