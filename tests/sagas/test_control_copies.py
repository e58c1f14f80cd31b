"""A loaded saga's control state is its own: changing it (the machine does, before a save that
may roll back) never changes what the store holds (the memory store keeps the envelopes it
returns)."""

from __future__ import annotations

import dataclasses

from eventflow.sagas.control import (
    Action,
    Control,
    Issued,
    Kept,
    Phase,
    Resume,
    Status,
    Timer,
    TimerKind,
    Wait,
    Waiting,
)
from eventflow.sagas.machine import Machine
from eventflow.sagas.persistence import SagaStore
from eventflow.stores import store_for

from .shop import OrderPlaced, OrderSaga, StockReserved


def test_from_dict_and_as_dict_share_nothing_with_their_input() -> None:
    charge = Timer(TimerKind.DEADLINE, "charge", 1.0, "t1", "step:")
    data = Control(key="k", done=["reserve"], timers={charge.key: charge}).as_dict()
    control = Control.from_dict(data)
    control.done.append("charge")
    control.timers["step:ship"] = Timer(TimerKind.DEADLINE, "ship", 3.0, "t2", "step:")
    assert data["done"] == ["reserve"]
    assert [t["name"] for t in data["timers"]] == ["charge"]
    out = control.as_dict()
    control.done.append("ship")
    control.timers.clear()
    assert out["done"] == ["reserve", "charge"]
    assert [t["name"] for t in out["timers"]] == ["charge", "ship"]


async def test_a_handling_that_rolls_back_leaves_the_stored_saga_as_it_was() -> None:
    store = store_for("memory://")
    await store.open()
    try:
        persistence = SagaStore(store)
        await persistence.setup()
        definition = OrderSaga.definition
        saga = OrderSaga()
        machine = Machine(saga, Control(key="o-1"), 1000.0)
        await machine.start(OrderPlaced(order_id="o-1"), "m-1", "m-1")
        async with store.transaction() as tx:
            await persistence.save(
                tx,
                definition,
                0,
                saga.model_dump(mode="json"),
                machine.control,
                machine.out,
                source="test",
                cause=None,
                now=1000.0,
            )
        before = await persistence.load(definition, "o-1")
        assert before is not None
        stored = before.control.as_dict()
        # A reply is applied to the loaded state, and the handling then fails (no save).
        loaded = await persistence.load(definition, "o-1")
        assert loaded is not None
        again = Machine(OrderSaga.model_validate(loaded.state), loaded.control, 1001.0)
        await again.message(
            StockReserved(order_id="o-1"),
            "m-2",
            loaded.control.issued[-1].id,
        )
        assert loaded.control.done == ["reserve"]  # the machine did change its copy
        after = await persistence.load(definition, "o-1")
        assert after is not None
        assert after.control.as_dict() == stored
    finally:
        await store.close()


async def test_a_loaded_state_shares_nothing_with_the_stored_one() -> None:
    """Fields typed ``Any`` (or dicts) keep what ``model_validate`` is given: a handling that
    changes one and then fails must not change the memory store's copy."""
    store = store_for("memory://")
    await store.open()
    try:
        persistence = SagaStore(store)
        definition = OrderSaga.definition
        saga = OrderSaga()
        machine = Machine(saga, Control(key="o-2"), 1000.0)
        await machine.start(OrderPlaced(order_id="o-2"), "m-1", "m-1")
        state = saga.model_dump(mode="json")
        state["extra_notes"] = {"seen": ["m-1"]}  # stands for a nested Any value
        async with store.transaction() as tx:
            await persistence.save(
                tx,
                definition,
                0,
                state,
                machine.control,
                machine.out,
                source="test",
                cause=None,
                now=1000.0,
            )
        first = await persistence.load(definition, "o-2")
        assert first is not None
        first.state["extra_notes"]["seen"].append("m-2")  # changed, then never saved
        again = await persistence.load(definition, "o-2")
        assert again is not None and again.state["extra_notes"] == {"seen": ["m-1"]}
    finally:
        await store.close()


def test_copy_is_the_json_round_trip_and_shares_nothing_that_changes() -> None:
    """The recent sagas a process keeps are copied with ``Control.copy``: the same control
    as ``from_dict(as_dict())``, and changing the copy leaves the original."""
    charge = Timer(TimerKind.DEADLINE, "charge", 1.0, "t1", "step:")
    original = Control(
        key="k",
        status=Status.FAILED,
        phase=Phase.COMPENSATING,
        at="charge",
        waiting=Waiting("charge", Wait.UNDO, "cmd-2"),
        issued=[Issued("cmd-1", "reserve", Action.DO, 1)],
        pivoted=True,
        reason="why",
        resume=Resume("charge", Action.UNDO, "why", charge, Status.RUNNING, (charge,)),
        done=["reserve"],
        undo=["reserve"],
        timers={charge.key: charge},
        attempts={"charge": 2},
        undo_attempts={"reserve": 1},
        kept=[Kept("m-0", {"id": "m-0", "data": {"a": 1}})],
        origin_ms=5,
        correlation_id="c",
        seq=3,
    )
    defaults = Control(key="")
    assert all(  # every field is set here, so the comparison below covers each one
        getattr(original, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(Control)
    )
    copied = original.copy()
    assert copied == Control.from_dict(original.as_dict())
    copied.done.append("charge")
    copied.undo.append("charge")  # type: ignore[union-attr]
    copied.timers.clear()
    copied.attempts["charge"] = 3
    copied.undo_attempts.clear()
    copied.kept[0].envelope["id"] = "changed"
    copied.kept.clear()
    assert original.as_dict() == Control.from_dict(original.as_dict()).as_dict()
    assert (original.done, original.undo, list(original.timers)) == (
        ["reserve"],
        ["reserve"],
        [charge.key],
    )
    assert original.attempts == {"charge": 2} and original.undo_attempts == {"reserve": 1}
    assert original.kept == [Kept("m-0", {"id": "m-0", "data": {"a": 1}})]
