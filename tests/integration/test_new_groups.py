"""Where an app's new groups begin, on the memory broker (a hub shared in one process):
the runtime subscribes each handler with its ``start``, and ``declare_groups`` over
``App.subscriptions`` (what ``eventflow groups declare`` runs) creates the groups of an app
that has not started yet, its sagas' included."""

from __future__ import annotations

import pytest

from eventflow import App, Event, Saga, subscribe
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.config import MemoryBrokerConfig
from eventflow.groups import GroupSpec, declare_groups
from eventflow.testing.broker_contract import eventually, unique_name


class Command(Event, type="it.newgroups.command"):
    order_id: str
    n: int


class Started(Event, type="it.newgroups.started"):
    order_id: str


class NewGroupsSaga(Saga, name="it.newgroups", start=Started, key="order_id"):
    """Nothing to do but start."""

    order_id: str = ""

    def started(self, e: Started) -> None:
        self.order_id = e.order_id


early: list[int] = []
late: list[int] = []


@subscribe("it.newgroups.command", group="early", start="earliest")
async def take_early(event: Command) -> None:
    early.append(event.n)


@subscribe("it.newgroups.command", group="late")
async def take_late(event: Command) -> None:
    late.append(event.n)


@pytest.fixture(autouse=True)
def _clear() -> None:
    early.clear()
    late.clear()


def _on(hub: str) -> MemoryBroker:
    return MemoryBroker(MemoryBrokerConfig(name=hub))


async def test_each_handler_begins_at_its_start_when_its_group_is_new() -> None:
    """Published before the app's first start: the ``start="earliest"`` handler gets it,
    the default one does not; both get what comes after (the positive control)."""
    hub = unique_name("hub")
    app = App("participant", broker=_on(hub), handlers=[take_early, take_late])
    async with App("sender", broker=_on(hub)) as sender:  # keeps the hub alive
        await sender.publish(Command(order_id="o-1", n=1), key="o-1")
        async with app:
            await sender.publish(Command(order_id="o-1", n=2), key="o-1")
            await eventually(lambda: early == [1, 2] and late == [2])


async def test_declared_groups_of_an_app_wait_for_its_first_start() -> None:
    """``declare_groups(broker, app.subscriptions)`` before the app runs: what is published
    then reaches its default-start handler at its first start; the saga's groups are among
    the app's subscriptions; declaring again finds them all existing."""
    hub = unique_name("hub")
    app = App("participant", broker=_on(hub), handlers=[take_late], sagas=[NewGroupsSaga])
    assert GroupSpec("saga.it.newgroups", "it.newgroups.started") in app.subscriptions
    async with App("sender", broker=_on(hub)) as sender:
        states = [s async for s in declare_groups(sender.broker, app.subscriptions)]
        assert [s.spec for s in states] == list(app.subscriptions)
        assert not any(s.existed for s in states)
        again = [s async for s in declare_groups(sender.broker, app.subscriptions, create=False)]
        assert all(s.existed for s in again)
        await sender.publish(Command(order_id="o-1", n=1), key="o-1")
        async with app:
            await eventually(lambda: late == [1])
