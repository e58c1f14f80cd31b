"""One registry, passed where it is used: a private ``EventRegistry`` given to an ``App``
or a ``Repository`` is what aggregate loading, ``RecordedEvent.event`` and ``@upcaster``
use, never the default registry behind it.

Two registries hold different upcasters for the same stored v1 event, so each test tells
which registry decoded it by the result.
"""

from __future__ import annotations

from typing import Any

import pytest

from eventflow import App, Event, UpcastError, upcaster
from eventflow.events import EventRegistry, default_registry, to_envelope
from eventflow.ports import RecordedEvent, Store
from eventflow.sourcing import Aggregate, Repository, on


class Priced1(Event, type="reg.priced", version=1):
    """The first version: a price in cents."""

    cents: int


class Priced(Event, type="reg.priced", version=2):
    """The current version: a price in cents and its currency."""

    cents: int
    currency: str


def _in_euros(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "currency": "EUR"}


def _in_dollars(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "currency": "USD"}


def _registry(fn: Any) -> EventRegistry:
    """A private registry knowing both classes, with ``fn`` upcasting v1 to v2."""
    registry = EventRegistry()
    registry.register(Priced1)
    registry.register(Priced)
    upcaster("reg.priced", from_version=1, registry=registry)(fn)
    return registry


EUROS = _registry(_in_euros)
DOLLARS = _registry(_in_dollars)


class Item(Aggregate, stream="reg_item"):
    """Applies the current price event."""

    prices: list[str] = []

    @on(Priced)
    def _priced(self, e: Priced) -> None:
        self.prices.append(f"{e.cents} {e.currency}")


async def _stored_v1(store: Store, item_id: str) -> None:
    old = to_envelope(Priced1(cents=100), source="", key=f"reg_item-{item_id}")
    await store.append(f"reg_item-{item_id}", [old, Priced(cents=250, currency="GBP")])


def test_upcaster_registers_into_the_registry_it_is_given() -> None:
    assert ("reg.priced", 1) in EUROS.upcasters()
    assert EUROS.upcasters()[("reg.priced", 1)] is _in_euros
    assert DOLLARS.upcasters()[("reg.priced", 1)] is _in_dollars
    assert ("reg.priced", 1) not in default_registry.upcasters()  # the default is untouched


def test_the_default_registry_has_no_upcaster_for_the_type() -> None:
    """The control: what the private registries decode, the default one cannot."""
    v1 = to_envelope(Priced1(cents=1), source="")
    with pytest.raises(UpcastError, match="no upcaster"):
        default_registry.decode(v1)


async def test_repositories_load_with_their_own_registry(store: Store) -> None:
    await _stored_v1(store, "i")
    in_euros = await Repository(Item, store, registry=EUROS).load("i")
    in_dollars = await Repository(Item, store, registry=DOLLARS).load("i")
    assert in_euros.prices == ["100 EUR", "250 GBP"]
    assert in_dollars.prices == ["100 USD", "250 GBP"]
    with pytest.raises(UpcastError):  # the default registry, which has no such upcaster
        await Repository(Item, store).load("i")


async def test_a_registry_with_only_upcasters_is_enough_for_aggregates(store: Store) -> None:
    """The aggregate's applier names the class; the registry only has to upcast."""
    await _stored_v1(store, "u")
    registry = EventRegistry()
    registry.add_upcaster("reg.priced", 1, _in_dollars)
    item = await Repository(Item, store, registry=registry).load("u")
    assert item.prices == ["100 USD", "250 GBP"]


async def test_app_repository_loads_with_the_app_registry() -> None:
    euros, dollars = App("eur", registry=EUROS), App("usd", registry=DOLLARS)
    async with euros, dollars:
        await _stored_v1(euros.store, "a")
        await _stored_v1(dollars.store, "a")
        assert euros.repository(Item).registry is EUROS
        assert (await euros.repository(Item).load("a")).prices == ["100 EUR", "250 GBP"]
        assert (await dollars.repository(Item).load("a")).prices == ["100 USD", "250 GBP"]


async def test_recorded_event_decodes_with_the_registry_it_carries(store: Store) -> None:
    await _stored_v1(store, "r")
    [rec, _] = [r async for r in store.read_stream("reg_item-r")]
    assert rec.registry is default_registry  # how a store hands it out
    in_euros = rec.with_registry(EUROS)
    assert in_euros.registry is EUROS and in_euros == rec
    assert in_euros.event == Priced(cents=100, currency="EUR")
    assert in_euros.event is in_euros.event  # decoded once
    assert rec.with_registry(DOLLARS).event == Priced(cents=100, currency="USD")
    assert rec.decode(DOLLARS) == Priced(cents=100, currency="USD")
    assert in_euros.with_registry(EUROS) is in_euros
    made = RecordedEvent(rec.stream_id, 1, rec.position, rec.envelope, EUROS)
    assert made.event == Priced(cents=100, currency="EUR")
    with pytest.raises(UpcastError):
        _ = rec.event  # the default registry has no upcaster for it
