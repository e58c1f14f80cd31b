"""DESIGN 5's rules on the message side, through the test kit (which runs the runtime's own
handling and timer code on a memory store): inputs in any order, aborts in flight, the
compensates header, late successes past the pivot, steps resumed by name across deploys,
saga code that raises, controls written by the first release."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ClassVar

import pytest

from eventflow import App, Context, Event, Saga, step, subscribe
from eventflow.adapters.memory import MemoryStore
from eventflow.errors import ConfigurationError
from eventflow.events import EventRegistry, envelope_for
from eventflow.headers import COMPENSATES_HEADER
from eventflow.sagas import on_timer
from eventflow.sagas.control import WAIT_ROW, Action, Control, Status, TimerKind, Wait
from eventflow.sagas.machine import Machine
from eventflow.sagas.runtime import Sagas
from eventflow.testing.sagas import SagaTest


class Placed(Event, type="rules.placed"):
    order_id: str


class Cancelled(Event, type="rules.cancelled"):
    order_id: str


class Reserve(Event, type="rules.reserve"):
    order_id: str


class Reserved(Event, type="rules.reserved"):
    order_id: str


class Release(Event, type="rules.release"):
    order_id: str


class Charge(Event, type="rules.charge"):
    order_id: str


class Charged(Event, type="rules.charged"):
    order_id: str


class Ship(Event, type="rules.ship"):
    order_id: str


class Shipped(Event, type="rules.shipped"):
    order_id: str


class Refused(Event, type="rules.refused"):
    order_id: str


class Validate(Event, type="rules.validate"):
    order_id: str


class Valid(Event, type="rules.valid"):
    order_id: str


class Notify(Event, type="rules.notify"):
    order_id: str


class Order(Saga, name="rules.order", start=Placed, key="order_id", abort=Cancelled):
    """reserve (compensated by release), charge (the pivot), ship (3 attempts)."""

    order_id: str = ""

    def started(self, e: Placed) -> None:
        self.order_id = e.order_id

    @step(reply=Reserved, timeout=30.0)
    def reserve(self) -> Event:
        return Reserve(order_id=self.order_id)

    @reserve.compensate
    def release(self) -> Event:
        return Release(order_id=self.order_id)

    @step(reply=Charged, timeout=30.0, pivot=True)
    def charge(self) -> Event:
        return Charge(order_id=self.order_id)

    @step(reply=Shipped, reject=Refused, timeout=10.0, retry=3, retry_delay=2.0)
    def ship(self) -> Event:
        return Ship(order_id=self.order_id)


async def _started(order_id: str = "o-1") -> SagaTest[Order]:
    t = SagaTest(Order)
    await t.given(Placed(order_id=order_id))
    return t


# -- inputs in any order -------------------------------------------------------------------


async def test_a_reply_before_the_start_is_kept_then_applied_after_it() -> None:
    t = SagaTest(Order)
    kept = await t.when(Reserved(order_id="o-1"))  # a foreign reply: matched by type
    assert kept.kinds == ["kept"] and kept.sent == ()
    assert t.status == "pending" and not t.started
    assert "1 inputs kept" in t.waits_for
    started = await t.given(Placed(order_id="o-1"))
    assert started.kinds == ["started", "command-sent", "replied", "command-sent"]
    t.then_sent(Reserve, Charge).then_waiting("charge")
    assert t.control.kept == []


async def test_an_abort_before_the_start_ends_the_saga_at_the_start_with_nothing_done() -> None:
    t = SagaTest(Order)
    await t.when(Cancelled(order_id="o-1"))
    await t.when(Reserved(order_id="o-1"))  # kept after the abort: changes nothing
    assert t.status == "pending"
    started = await t.given(Placed(order_id="o-1"))
    assert started.kinds[:4] == ["started", "aborted", "compensating", "compensated"]
    assert started.kinds[4:] == ["ignored"]
    t.then_status("compensated", reason="aborted by rules.cancelled").then_sent()
    assert t.timers == {}


async def test_without_an_abort_the_kept_inputs_control_is_the_usual_start() -> None:
    t = SagaTest(Order)
    await t.given(Placed(order_id="o-1"))
    t.then_sent(Reserve).then_status("running")  # the positive control of the test above


async def test_a_pending_saga_is_listed_and_its_kept_input_survives_a_failed_start() -> None:
    """Through the runtime's handling on a store: ``pending`` in ``sagas list``; the kept
    input is in the saga's stream, not in memory."""
    store = MemoryStore()
    sagas = Sagas(store, EventRegistry(), "rules")
    handling = sagas.handling
    await sagas.persistence.setup()
    cancel = envelope_for(Cancelled(order_id="o-7"), source="t", key="o-7")
    async with store.transaction() as tx:
        await handling.message(tx, Order, Cancelled(order_id="o-7"), cancel)
    (row,) = await sagas.list(status="pending")
    assert (row.id, row.status) == ("saga-rules.order-o-7", "pending")
    assert await sagas.list(status="running") == []
    placed = envelope_for(Placed(order_id="o-7"), source="t", key="o-7")
    async with store.transaction() as tx:
        machine = await handling.message(tx, Order, Placed(order_id="o-7"), placed)
    assert machine is not None and handling.sends(Order.definition, machine, placed) == []
    saga = await sagas.get(Order, "o-7")
    assert saga is not None and saga.status == "compensated"
    assert [h.kind for h in saga.history][:2] == ["kept", "started"]


# -- abort in flight, compensations ----------------------------------------------------------


async def test_a_compensation_names_the_command_it_undoes() -> None:
    t = await _started()
    await t.when(Cancelled(order_id="o-1"))
    t.then_status("compensating").then_waiting("reserve")  # its command is in flight
    await t.when_reply(Reserved(order_id="o-1"))
    reserve, release = t.sent
    assert (release.kind, release.step) == ("compensation", "reserve")
    assert release.envelope.headers[COMPENSATES_HEADER] == reserve.id
    assert COMPENSATES_HEADER not in reserve.envelope.headers
    t.then_status("compensated")


async def test_a_second_abort_while_one_waits_for_the_step_changes_nothing() -> None:
    t = await _started()
    await t.when(Cancelled(order_id="o-1"))
    again = await t.abort(by="ana")
    assert again.kinds == ["ignored"] and "already compensating" in again.transitions[0].detail
    t.then_waiting("reserve")


# -- saga code that raises -----------------------------------------------------------------


class Flaky(Saga, name="rules.flaky", start=Placed, key="order_id"):
    """Its timer method raises while ``broken``; its reply handler raises on ``Refused``."""

    fail_next: ClassVar[bool] = True

    order_id: str = ""
    nudged: int = 0

    def started(self, e: Placed) -> None:
        self.order_id = e.order_id
        self.set_timer("nudge", 5.0)

    @step(reply=Shipped, timeout=60.0)
    def ship(self) -> Event:
        return Ship(order_id=self.order_id)

    @ship.on_reply
    def _shipped(self, e: Shipped) -> None:
        if self.order_id == "bad-reply":
            raise RuntimeError("bug in on_reply")

    @on_timer("nudge")
    def _nudge(self) -> Event:
        if type(self).fail_next:
            raise RuntimeError("bug in a timer method")
        self.nudged += 1
        return Notify(order_id=self.order_id)


async def test_a_timer_method_that_raises_fails_its_saga_and_retry_fires_it_again() -> None:
    Flaky.fail_next = True
    t = SagaTest(Flaky)
    await t.given(Placed(order_id="o-1"))
    (fired,) = await t.advance(5.0)
    assert fired.kinds == ["failed"] and fired.sent == ()
    t.then_status("failed", reason="timer nudge raised RuntimeError('bug in a timer method')")
    assert t.timers == {}  # a failed saga fires nothing: its step's deadline waits with it
    assert await t.advance(100.0) == []
    resume = t.control.resume
    assert resume is not None and resume.timer is not None and resume.status is Status.RUNNING
    Flaky.fail_next = False
    retried = await t.retry(by="ana")
    assert retried.kinds == ["retried", "timer-fired"]
    assert [s.event for s in retried.sent] == [Notify(order_id="o-1")]
    assert t.timers == {"step:ship": -45.0}  # set again as it was: overdue, fires next
    t.then_status("running").then_waiting("ship")
    assert t.saga.nudged == 1
    await t.when_reply(Shipped(order_id="o-1"))
    t.then_status("completed")
    assert t.timers == {}


async def test_saga_code_that_raises_on_a_message_fails_the_handling_and_changes_nothing() -> None:
    t = SagaTest(Flaky)
    await t.given(Placed(order_id="bad-reply"))
    with pytest.raises(RuntimeError, match="bug in on_reply"):
        await t.when_reply(Shipped(order_id="bad-reply"))
    t.then_status("running").then_waiting("ship")  # rolled back: as before the message
    assert [a.input for a in t.applied] == ["start Placed"]
    ok = SagaTest(Flaky)  # the positive control: the same reply to a sound saga
    await ok.given(Placed(order_id="good"))
    await ok.when_reply(Shipped(order_id="good"))
    ok.then_status("completed")


# -- steps by name across deploys ----------------------------------------------------------


class OrderWithValidation(Saga, name="rules.order", start=Placed, key="order_id", abort=Cancelled):
    """The next release: a step in front (validate), the rest as before."""

    order_id: str = ""

    def started(self, e: Placed) -> None:
        self.order_id = e.order_id

    @step(reply=Valid, timeout=30.0)
    def validate(self) -> Event:
        return Validate(order_id=self.order_id)

    @step(reply=Reserved, timeout=30.0)
    def reserve(self) -> Event:
        return Reserve(order_id=self.order_id)

    @reserve.compensate
    def release(self) -> Event:
        return Release(order_id=self.order_id)

    @step(reply=Charged, timeout=30.0, pivot=True)
    def charge(self) -> Event:
        return Charge(order_id=self.order_id)

    @step(reply=Shipped, reject=Refused, timeout=10.0, retry=3, retry_delay=2.0)
    def ship(self) -> Event:
        return Ship(order_id=self.order_id)


class OrderWithoutShipping(Saga, name="rules.order", start=Placed, key="order_id"):
    """A release that removed the ship step."""

    order_id: str = ""

    @step(reply=Reserved, timeout=30.0)
    def reserve(self) -> Event:
        return Reserve(order_id=self.order_id)

    @step(reply=Charged, timeout=30.0, pivot=True)
    def charge(self) -> Event:
        return Charge(order_id=self.order_id)


class OrderReordered(Saga, name="rules.order", start=Placed, key="order_id"):
    """A release that moved reserve after charge and added a last step."""

    order_id: str = ""

    @step(reply=Charged, timeout=30.0, pivot=True)
    def charge(self) -> Event:
        return Charge(order_id=self.order_id)

    @step(reply=Reserved, timeout=30.0)
    def reserve(self) -> Event:
        return Reserve(order_id=self.order_id)

    @step()
    def notify(self) -> Event:
        return Notify(order_id=self.order_id)


async def test_a_deploy_adding_a_leading_step_resumes_a_backing_off_saga_at_its_step() -> None:
    t = await _started()
    await t.when_reply(Reserved(order_id="o-1"))
    await t.when_reply(Charged(order_id="o-1"))
    await t.when_reply(Refused(order_id="o-1"))
    t.then_waiting("ship", "retry")
    t.deploy(OrderWithValidation)
    (resent,) = await t.advance(2.0)
    assert [(s.step, s.attempt) for s in resent.sent] == [("ship", 2)]
    await t.when_reply(Shipped(order_id="o-1"))
    t.then_status("completed").then_sent(Reserve, Charge, Ship, Ship)  # charged once


async def test_a_person_retry_after_a_deploy_resumes_the_failed_step_by_name() -> None:
    t = await _started()
    await t.when_reply(Reserved(order_id="o-1"))
    await t.when_reply(Charged(order_id="o-1"))
    for delay in (2.0, 4.0, 0.0):
        await t.when_reply(Refused(order_id="o-1"))
        await t.advance(delay)
    t.then_status("failed")
    t.deploy(OrderWithValidation)
    retried = await t.retry(by="ana")
    assert [(s.step, s.attempt) for s in retried.sent] == [("ship", 4)]


async def test_a_deploy_that_removes_the_step_a_saga_is_at_fails_it_saying_so() -> None:
    t = await _started()
    await t.when_reply(Reserved(order_id="o-1"))
    await t.when_reply(Charged(order_id="o-1"))
    t.then_waiting("ship")
    t.deploy(OrderWithoutShipping)  # which handles no Shipped any more: its deadline fires
    (applied,) = await t.advance(10.0)
    assert applied.kinds == ["failed"] and applied.sent == ()
    t.then_status("failed", reason="step ship is not in saga rules.order's definition any more")
    t.deploy(Order)  # deployed back: a person retries
    await t.retry(by="ana")
    await t.when_reply(Shipped(order_id="o-1"))
    t.then_status("completed")


async def test_a_deploy_that_reorders_steps_goes_on_after_the_step_the_saga_is_at() -> None:
    t = await _started()
    await t.when_reply(Reserved(order_id="o-1"))
    t.then_waiting("charge")
    t.deploy(OrderReordered)
    last = await t.when_reply(Charged(order_id="o-1"))
    # After charge: reserve is done already (not sent again), then the new notify.
    assert [s.event for s in last.sent] == [Notify(order_id="o-1")]
    t.then_status("completed")


# -- the first release's control ---------------------------------------------------------------


def test_a_control_of_the_first_release_reads_into_the_typed_form() -> None:
    legacy = {
        "key": "o-1",
        "status": "running",
        "phase": "forward",
        "next_step": 2,
        "waiting": {"step": "ship", "kind": "do", "command_id": "c-ship-2"},
        "done": ["reserve", "charge"],
        "undo": [],
        "timers": {
            "step:ship": {"due": 100.0, "token": "7:step:ship"},
            "reminder": {"due": 50.0, "token": "3:reminder"},
        },
        "issued": ["c-reserve", "c-charge", "c-ship-1", "c-ship-2"],
        "attempts": {"reserve": 1, "charge": 1, "ship": 2, "undo:reserve": 1},
        "pivoted": True,
        "reason": None,
        "resume": None,
        "origin_ms": 1000,
        "correlation_id": "corr",
        "seq": 7,
    }
    c = Control.from_dict(legacy)
    assert (c.status, c.at, c.done) == (Status.RUNNING, "ship", ["reserve", "charge"])
    assert c.waiting is not None and (c.waiting.step, c.waiting.wait) == ("ship", Wait.REPLY)
    assert {k: (t.kind, t.name) for k, t in c.timers.items()} == {
        "step:ship": (TimerKind.DEADLINE, "ship"),
        "reminder": (TimerKind.NAMED, "reminder"),
    }
    assert (c.attempts, c.undo_attempts) == ({"reserve": 1, "charge": 1, "ship": 2}, {"reserve": 1})
    assert c.issued_as("c-ship-2") is not None and c.issued_as("c-ship-2").attempt == 2  # type: ignore[union-attr]
    assert c.issued_as("c-reserve") is not None  # still known as this saga's command
    assert c.last_issued("ship", Action.DO) is not None
    again = Control.from_dict(c.as_dict())
    assert again.as_dict() == c.as_dict()


async def test_a_saga_of_the_first_release_goes_on_with_its_own_timer_rows() -> None:
    legacy = {
        "key": "o-1",
        "status": "running",
        "phase": "forward",
        "next_step": 2,
        "waiting": {"step": "ship", "kind": "do", "command_id": "c-ship"},
        "done": ["reserve", "charge"],
        "timers": {"step:ship": {"due": 100.0, "token": "7:step:ship"}},
        "issued": ["c-reserve", "c-charge", "c-ship"],
        "attempts": {"ship": 1},
        "pivoted": True,
        "origin_ms": 1000,
        "seq": 7,
    }
    fired = Machine(Order(order_id="o-1"), Control.from_dict(legacy), 101.0)
    out = await fired.timer("step:ship", "7:step:ship", "m-1")  # its row, as the loop reads it
    assert [t.kind for t in out.transitions] == ["timed-out", "retry-scheduled"]
    assert out.timers_cancelled == {"step:ship"} and set(out.timers_set) == {WAIT_ROW}
    replied = Machine(Order(order_id="o-1"), Control.from_dict(legacy), 50.0)
    out = await replied.message(Shipped(order_id="o-1"), "m-2", "c-ship")
    assert [t.kind for t in out.transitions] == ["replied", "completed"]
    assert out.timers_cancelled == {"step:ship"}


# -- the class keywords --------------------------------------------------------------------


def test_the_handlers_take_the_options_declared_on_the_class() -> None:
    class Tuned(
        Saga,
        name="rules.tuned",
        start=Placed,
        key="order_id",
        concurrency=3,
        retry=2,
        timeout=4.5,
    ):
        order_id: str = ""

    d = Tuned.definition
    assert (d.concurrency, d.retry.max_attempts, d.timeout) == (3, 2, 4.5)
    assert (Order.definition.concurrency, Order.definition.timeout) == (8, 30.0)


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"concurrency": 0}, "concurrency=0 counts sagas handled at once"),
        ({"timeout": 0}, "timeout=0 is the seconds one handling may take"),
        ({"retry": 0}, "retry"),
    ],
)
def test_bad_handler_options_are_refused_at_class_creation(
    option: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):

        class Bad(Saga, name="rules.bad", start=Placed, key="order_id", **option):  # type: ignore[misc]
            order_id: str = ""


def test_a_field_without_a_default_is_refused_with_the_remedy() -> None:
    with pytest.raises(ConfigurationError, match=r"field\(s\) sku of NoDefault have no default"):

        class NoDefault(Saga, name="rules.nodefault", start=Placed, key="order_id"):
            order_id: str = ""
            sku: str


# -- the same in an app: saga code that raises on a message ------------------------------------


class Brittle(
    Saga, name="rules.brittle", start=Placed, key="order_id", retry=2, timeout=5.0, concurrency=2
):
    """Its reply handler raises for the key ``bad``: the handling fails (twice: retry=2)."""

    order_id: str = ""
    shipped: bool = False

    def started(self, e: Placed) -> None:
        self.order_id = e.order_id

    @step(reply=Shipped, timeout=600.0)
    def ship(self) -> Event:
        return Ship(order_id=self.order_id)

    @ship.on_reply
    def _shipped(self, e: Shipped) -> None:
        if self.order_id == "bad":
            raise RuntimeError("bug in on_reply")
        self.shipped = True


async def test_in_an_app_a_raising_reply_handler_is_dead_lettered_and_the_saga_unchanged(
    broker_url: str, waiter: Callable[..., Awaitable[None]]
) -> None:
    @subscribe(Ship.event_type, group="rules.shipping")
    async def ship(cmd: Ship, ctx: Context) -> None:
        await ctx.publish(Shipped(order_id=cmd.order_id))

    app = App("rules-app", broker=broker_url, handlers=[ship], sagas=[Brittle])
    specs = [s for s in app._specs if s.group == "saga.rules.brittle"]
    assert {(s.concurrency, s.retry.max_attempts, s.timeout) for s in specs} == {(2, 2, 5.0)}
    async with app:
        for key in ("bad", "good"):
            await app.publish(Placed(order_id=key), key=key)

        async def settled() -> bool:
            good = await app.sagas.get(Brittle, "good")
            letters = await app.store.dead_letters.list(group="saga.rules.brittle")
            return good is not None and good.status == "completed" and len(letters) == 1

        await waiter(settled, what="good completed and bad's reply dead-lettered")
        bad = await app.sagas.get(Brittle, "bad")
        (letter,) = await app.store.dead_letters.list(group="saga.rules.brittle")
    assert bad is not None and bad.status == "running" and not bad.shipped
    assert [h.kind for h in bad.history] == ["started", "command-sent"]  # unchanged
    assert "bug in on_reply" in letter.error


def test_two_sagas_share_no_private_state() -> None:
    """The private attributes have copied defaults (not a factory pydantic inspects on every
    instance): one saga's effects and meta are never another's."""
    a, b = Order(), Order()
    a._effects.append(Cancelled(order_id="x"))  # type: ignore[arg-type]
    a._meta["key"] = "a"
    assert b._effects == [] and b._meta == {} and Order()._meta == {}
    loaded = Order.model_validate({"order_id": "o-1"})  # how the runtime loads one
    assert loaded._meta == {} and loaded._effects == [] and loaded._meta is not a._meta
