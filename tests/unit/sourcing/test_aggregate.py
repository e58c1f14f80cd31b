"""``Aggregate``: state fields, ``@on`` appliers, ``record()``, class keywords."""

from __future__ import annotations

import pytest

from eventflow import ConfigurationError, Event, UnknownEventTypeError
from eventflow.sourcing import Aggregate, on
from eventflow.sourcing.aggregate import stream_name

from .domain import Cart, CheckedOut, ItemAdded, Noted


def test_a_new_aggregate_is_at_version_0_with_default_state() -> None:
    cart = Cart(id="c-1")
    assert (cart.id, cart.version, cart.saved_version) == ("c-1", 0, 0)
    assert cart.items == {}
    assert cart.checked_out is False
    assert cart.pending == ()


def test_record_applies_the_event_and_queues_it() -> None:
    cart = Cart(id="c-1")
    first, second = ItemAdded(sku="a", qty=2), ItemAdded(sku="a", qty=3)
    cart.record(first)
    cart.record(second)
    assert cart.items == {"a": 5}
    assert cart.version == 2
    assert cart.saved_version == 0
    assert cart.pending == (first, second)


def test_mutable_defaults_are_not_shared_between_instances() -> None:
    one, two = Cart(id="1"), Cart(id="2")
    one.add("a", 1)
    assert two.items == {}


def test_recording_an_event_without_applier_names_the_fix() -> None:
    cart = Cart(id="c-1")
    with pytest.raises(
        UnknownEventTypeError,
        match=r"no @on method for event type 'agg\.cart\.noted'.*ignore_unknown_events=True",
    ):
        cart.record(Noted(text="hi"))
    assert cart.version == 0
    assert cart.pending == ()


def test_record_refuses_things_that_are_not_events() -> None:
    with pytest.raises(ConfigurationError, match="Event subclass"):
        Cart(id="c-1").record({"sku": "a"})  # type: ignore[arg-type]


def test_ignore_unknown_events_queues_without_applying() -> None:
    class Lenient(Aggregate, ignore_unknown_events=True):
        count: int = 0

        @on(ItemAdded)
        def _added(self, e: ItemAdded) -> None:
            self.count += 1

    agg = Lenient(id="l")
    agg.record(Noted(text="x"))
    agg.record(ItemAdded(sku="a", qty=1))
    assert agg.count == 1
    assert agg.version == 2
    assert [type(e) for e in agg.pending] == [Noted, ItemAdded]


def test_an_applier_that_raises_leaves_version_and_pending_unchanged() -> None:
    class Strict(Aggregate):
        n: int = 0

        @on(ItemAdded)
        def _added(self, e: ItemAdded) -> None:
            if e.qty < 0:
                raise ValueError("negative")
            self.n += e.qty

    agg = Strict(id="s")
    with pytest.raises(ValueError, match="negative"):
        agg.record(ItemAdded(sku="a", qty=-1))
    assert (agg.version, agg.pending, agg.n) == (0, (), 0)


def test_an_applier_assigning_an_undeclared_attribute_fails() -> None:
    class Typo(Aggregate):
        status: str = "new"

        @on(CheckedOut)
        def _done(self, e: CheckedOut) -> None:
            self.stauts = "done"

    with pytest.raises(ValueError, match="stauts"):
        Typo(id="t").record(CheckedOut())


def test_stream_prefix_defaults_to_snake_case_class_name() -> None:
    class ShoppingCart(Aggregate):
        pass

    class HTTPSession(Aggregate):
        pass

    assert ShoppingCart.aggregate_stream == "shopping_cart"
    assert HTTPSession.aggregate_stream == "http_session"
    assert Cart.aggregate_stream == "cart"
    assert stream_name("Order") == "order"


def test_stream_keyword_is_validated() -> None:
    with pytest.raises(ConfigurationError, match="no '-'"):

        class Bad(Aggregate, stream="my-orders"):
            pass


def test_snapshot_version_keyword_is_validated_and_inherited() -> None:
    class V3(Aggregate, snapshot_version=3):
        pass

    class Child(V3):
        pass

    assert (V3.snapshot_version, Child.snapshot_version, Cart.snapshot_version) == (3, 3, 1)
    with pytest.raises(ConfigurationError, match="snapshot_version"):

        class Bad(Aggregate, snapshot_version=0):
            pass


def test_async_appliers_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="not `async def`"):

        class Async(Aggregate):
            @on(ItemAdded)
            async def _added(self, e: ItemAdded) -> None:
                pass


def test_a_subclass_overrides_its_base_applier() -> None:
    class Counting(Cart):
        adds: int = 0

        @on(ItemAdded)
        def _added(self, e: ItemAdded) -> None:
            self.adds += 1

    agg = Counting(id="x")
    agg.record(ItemAdded(sku="a", qty=5))
    agg.record(CheckedOut())
    assert (agg.adds, agg.items, agg.checked_out) == (1, {}, True)
    assert Counting.aggregate_stream == "counting"


def test_one_method_may_apply_several_types() -> None:
    class Another(Event, type="agg.misc.another"):
        pass

    class Counter(Aggregate):
        seen: list[str] = []

        @on(ItemAdded, Another)
        def _any(self, e: ItemAdded | Another) -> None:
            self.seen.append(e.event_type)

    agg = Counter(id="c")
    agg.record(Another())
    agg.record(ItemAdded(sku="a", qty=1))
    assert agg.seen == ["agg.misc.another", "agg.cart.item_added"]
