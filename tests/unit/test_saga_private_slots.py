"""A saga's private attributes (``_meta``: key, status, history; ``_effects``: what its
methods asked for) are the instance's own, made when first read: never shared between
instances (a default shared by two sagas would leak one saga's timers or status into
another), kept by copies and pickling as pydantic keeps private attributes, and never
part of the saved state."""

from __future__ import annotations

import copy
import pickle

from pydantic import PrivateAttr

from eventflow import Event, Saga, on_timer, step


class SlotBegun(Event, type="ut.slots.begun"):
    order_id: str


class SlotDone(Event, type="ut.slots.done"):
    order_id: str


class SlotSaga(Saga, name="ut.slots", start=SlotBegun, key="order_id"):
    order_id: str = ""

    @step(reply=SlotDone)
    def work(self) -> None:
        return None

    @on_timer("remind")
    def remind(self) -> None:
        return None


def test_each_instance_has_its_own_meta_and_effects() -> None:
    one, two = SlotSaga(), SlotSaga.model_validate({"order_id": "o-2"})
    one.set_timer("remind", 5)
    one._meta["status"] = "failed"
    assert two._effects == [] and two._meta == {}
    assert two.status == "running" and one.status == "failed"
    assert SlotSaga()._effects == [] and SlotSaga()._meta == {}


def test_they_are_not_state_and_copies_keep_them() -> None:
    saga = SlotSaga.model_validate({"order_id": "o-1"})
    saga._meta.update(key="o-1", status="completed")
    assert saga.model_dump() == {"order_id": "o-1"}
    assert "_meta" not in saga.model_dump_json()
    for copied in (saga.model_copy(), copy.deepcopy(saga), pickle.loads(pickle.dumps(saga))):
        assert copied.key == "o-1" and copied.status == "completed"
    deep = saga.model_copy(deep=True)
    deep._meta["status"] = "failed"
    assert saga.status == "completed"
    saga._meta = {"status": "compensated"}  # assignment goes to the instance's own slot
    assert saga.status == "compensated" and SlotSaga().status == "running"


def test_a_saga_with_private_attributes_of_its_own_keeps_both() -> None:
    class Noted(SlotSaga, name="ut.slots.noted", start=SlotBegun, key="order_id"):
        _notes: list[str] = PrivateAttr(default_factory=list)

    saga = Noted.model_validate({"order_id": "o-1"})
    saga._notes.append("n")
    saga._meta["key"] = "o-1"
    assert saga._notes == ["n"] and saga.key == "o-1"
    assert Noted()._notes == [] and Noted().key == ""
