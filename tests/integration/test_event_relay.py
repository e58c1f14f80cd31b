"""The event relay (``App(relay_events=True)``) publishes the services' events, never
eventflow's own records (types ``eventflow.*``: a saga's transitions)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import pytest

from eventflow import App, Event, Saga, step
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.config import MemoryBrokerConfig
from eventflow.errors import EventTypeError
from eventflow.events import INTERNAL_TYPE_PREFIX, is_internal_type
from eventflow.runtime.relay import EVENT_RELAY_CHECKPOINT, EventRelay
from eventflow.stores import open_store, store_for

Wait = Callable[..., Awaitable[None]]


class RelayPlaced(Event, type="it.relay.placed"):
    """Starts the saga."""

    order_id: str


class RelayNoted(Event, type="it.relay.noted"):
    """A service's own event, appended to the store."""

    order_id: str


class NoteSaga(Saga, name="it_relay_note", start=RelayPlaced, key="order_id"):
    """One local step: the saga completes at once, leaving its transitions in its stream."""

    order_id: str = ""

    def started(self, e: RelayPlaced) -> None:
        self.order_id = e.order_id

    @step()
    def note(self) -> None:
        return None


class TopicsBroker(MemoryBroker):
    """A memory broker that remembers the topic of every publish."""

    def __init__(self, name: str) -> None:
        super().__init__(MemoryBrokerConfig(name=name))
        self.topics: list[str] = []

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.topics.append(topic)
        await super().publish(topic, payload, key=key, headers=headers)


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_the_event_relay_publishes_no_saga_transition(
    store_kind: str, broker_name: str, tmp_path: Path, waiter: Wait
) -> None:
    """A saga runs to its end (its transitions are in its stream), then a service's event is
    appended after them: the relay publishes that event, passes over every transition
    (counted as skipped) and moves its checkpoint past them all."""
    url = "memory://" if store_kind == "memory" else f"sqlite:///{tmp_path / 'relay.db'}"
    store = store_for(url)
    broker = TopicsBroker(broker_name)
    app = App("it-relay-sagas", broker=broker, store=store, sagas=[NoteSaga], relay_events=True)
    async with app:
        await app.publish(RelayPlaced(order_id="o-1"), key="o-1")

        async def completed() -> bool:
            saga = await app.sagas.get(NoteSaga, "o-1")
            return saga is not None and saga.status == "completed"

        await waiter(completed, what="the saga completed")
        transitions = [rec async for rec in store.read_stream("saga-it_relay_note-o-1")]
        assert transitions and all(is_internal_type(r.envelope.type) for r in transitions)
        await store.append("notes-o-1", [RelayNoted(order_id="o-1")])
        await waiter(lambda: "it.relay.noted" in broker.topics, what="the service's event")
        # The relay publishes in store order: a transition it sent would be there by now.
        internal = [t for t in broker.topics if t.startswith(INTERNAL_TYPE_PREFIX)]
        assert not internal, f"the relay published eventflow's own records: {broker.topics}"
        [relay] = [r for r in app._relays if isinstance(r, EventRelay)]
        assert relay.skipped >= len(transitions)
        assert relay.sent == 1
        last = await store.last_position()
    async with open_store(store) as again:  # reopened: what the relay saved on stop
        assert await again.checkpoints.get(EVENT_RELAY_CHECKPOINT) == last


def test_an_event_class_may_not_take_a_type_of_eventflows_own() -> None:
    """``eventflow.*`` types are eventflow's records: a service's Event class naming one is
    refused at once, with what to do."""
    with pytest.raises(EventTypeError, match="eventflow keeps for its own records"):

        class Sneaky(Event, type="eventflow.saga.transition"):
            n: int
