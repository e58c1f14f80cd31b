"""Producers validate before publishing: an invalid event raises and nothing is sent."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from pydantic import Field

from eventflow import App, Context, Envelope, Event, EventValidationError, subscribe

Wait = Callable[..., Awaitable[None]]


class Parcel(Event, type="schema.test.parcel"):
    parcel_id: str
    weight: int = Field(gt=0)


class Shipped(Event, type="schema.test.shipped"):
    parcel_id: str


def _invalid_parcels() -> list[Parcel]:
    good = Parcel(parcel_id="p-1", weight=2)
    return [
        Parcel.model_construct(parcel_id="p-1", weight="heavy"),  # wrong type
        Parcel.model_construct(parcel_id="p-1"),  # missing field
        good.model_copy(update={"weight": -1}),  # constraint broken
    ]


@pytest.mark.parametrize("bad", _invalid_parcels(), ids=["type", "missing", "constraint"])
async def test_app_publish_refuses_invalid_events(bad: Parcel, broker_url: str) -> None:
    seen: list[Envelope] = []

    @subscribe("schema.test.parcel", group="watch")
    async def watch(env: Envelope) -> None:
        seen.append(env)

    async with App("producer", broker=broker_url, handlers=[watch]) as app:
        # Only the clear error: no serializer warning first (filterwarnings=error).
        with pytest.raises(EventValidationError) as info:
            await app.publish(bad)
        await app.publish(Parcel(parcel_id="p-2", weight=1))
        await _until(lambda: len(seen) == 1)

    message = str(info.value)
    assert "refusing 'schema.test.parcel' v1" in message
    assert "weight" in message and "Nothing was published or appended" in message
    assert [env.data["parcel_id"] for env in seen] == ["p-2"]  # the invalid one never left


async def test_ctx_publish_refuses_invalid_events(broker_url: str) -> None:
    errors: list[str] = []
    shipped: list[Envelope] = []

    @subscribe("schema.test.parcel", group="ship", retry=1)
    async def ship(parcel: Parcel, ctx: Context) -> None:
        try:
            await ctx.publish(Shipped.model_construct())
        except EventValidationError as exc:
            errors.append(str(exc))
        await ctx.publish(Shipped(parcel_id=parcel.parcel_id))

    @subscribe("schema.test.shipped", group="audit")
    async def audit(env: Envelope) -> None:
        shipped.append(env)

    async with App("producer2", broker=broker_url, handlers=[ship, audit]) as app:
        await app.publish(Parcel(parcel_id="p-9", weight=3))
        await _until(lambda: len(shipped) == 1)

    assert len(errors) == 1 and "parcel_id" in errors[0]
    assert shipped[0].data == {"parcel_id": "p-9"}


async def test_envelopes_are_published_as_given(broker_url: str) -> None:
    seen: list[Envelope] = []

    @subscribe("schema.test.parcel", group="raw")
    async def raw(env: Envelope) -> None:
        seen.append(env)

    async with App("producer3", broker=broker_url, handlers=[raw]) as app:
        await app.publish(Envelope.create("schema.test.parcel", {"weight": "any"}))
        await _until(lambda: len(seen) == 1)

    assert seen[0].data == {"weight": "any"}


async def _until(condition: Callable[[], bool]) -> None:
    import asyncio

    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


class Crate(Event, type="schema.test.crate"):
    """An event with a list field (unhashable, so it cannot sit in a set)."""

    items: list[int]


async def test_unvalidated_marks_go_by_identity_and_survive_copies() -> None:
    """Events with list fields publish fine after a model_construct elsewhere; a bad one
    built without validation is refused, and so are its copies, deep copies, model copies
    and pickles (even once the original is gone)."""
    import copy
    import gc
    import pickle

    async with App("producer", broker="memory://") as app:
        Parcel.model_construct(parcel_id="p-0", weight=1)  # any unvalidated instance
        await app.publish(Crate(items=[1, 2]))  # validated: not looked up by value
        bad = Crate.model_construct(items="not a list")
        made = [copy.copy(bad), copy.deepcopy(bad), bad.model_copy(), pickle.dumps(bad)]
        equal_but_valid = Crate(items=[3])
        del bad
        gc.collect()
        for each in made[:3]:
            with pytest.raises(EventValidationError):
                await app.publish(each)
        with pytest.raises(EventValidationError):
            await app.publish(pickle.loads(made[3]))
        await app.publish(pickle.loads(pickle.dumps(equal_but_valid)))


class _OwnBytes(Envelope):
    """An envelope subclass with its own wire form."""

    def to_bytes(self) -> bytes:
        return b"own:" + super().to_bytes()


async def test_an_envelope_subclass_is_sent_in_its_own_wire_form() -> None:
    from eventflow.adapters.memory import MemoryBroker
    from eventflow.adapters.memory.broker import MemoryBrokerConfig

    broker = MemoryBroker(MemoryBrokerConfig(name="own-bytes"))
    async with App("producer", broker=broker) as app:
        sub = await broker.subscribe("schema.test.own", group="raw")
        env = _OwnBytes.create("schema.test.own", {"n": 1})
        await app.publish(env)
        (delivery,) = await sub.fetch(1, 1.0)
        assert delivery.payload == env.to_bytes()
        await delivery.ack()


@pytest.mark.parametrize("bad", _invalid_parcels(), ids=["type", "missing", "constraint"])
async def test_event_store_refuses_invalid_events(bad: Parcel) -> None:
    """An event built without validation is refused by the store's append as by publish:
    every envelope made from an Event is checked on the one path that makes it."""
    from eventflow.adapters.memory import MemoryStore

    store = MemoryStore()
    with pytest.raises(EventValidationError, match="weight"):
        await store.append("parcel-1", [bad])
    await store.append("parcel-1", [Parcel(parcel_id="p-1", weight=2)])
    assert [r.envelope.data["weight"] async for r in store.read_stream("parcel-1")] == [2]
