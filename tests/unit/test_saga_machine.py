"""The saga state machine, input by input, through the test kit (``eventflow.testing.sagas``):
the order saga's paths, compensations with replies, the pivot's retries, aborts, named
timers, late and stray inputs, local and async steps, command ids and the reload round trip;
and the kit's own errors and documentation."""

from __future__ import annotations

import asyncio
import re
import sys
import types
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from eventflow import App, Context, Event, Saga, on_timer, step, subscribe
from eventflow.testing.sagas import SagaTest, SagaTestError, Sent


class OrderPlaced(Event, type="ut.saga.order.placed"):
    order_id: str
    sku: str = "sku-1"
    qty: int = 1
    amount: int = 100


class OrderCancelled(Event, type="ut.saga.order.cancelled"):
    order_id: str


class ReserveStock(Event, type="ut.saga.stock.reserve"):
    order_id: str
    sku: str
    qty: int


class StockReserved(Event, type="ut.saga.stock.reserved"):
    order_id: str
    left: int = 10


class StockRejected(Event, type="ut.saga.stock.rejected"):
    order_id: str


class ReleaseStock(Event, type="ut.saga.stock.release"):
    order_id: str


class ChargePayment(Event, type="ut.saga.payment.charge"):
    order_id: str
    amount: int


class PaymentCharged(Event, type="ut.saga.payment.charged"):
    order_id: str
    charge_id: str


class PaymentDeclined(Event, type="ut.saga.payment.declined"):
    order_id: str


class RefundPayment(Event, type="ut.saga.payment.refund"):
    order_id: str
    charge_id: str | None


class PaymentRefunded(Event, type="ut.saga.payment.refunded"):
    order_id: str


class ShipOrder(Event, type="ut.saga.shipping.ship"):
    order_id: str


class OrderShipped(Event, type="ut.saga.shipping.shipped"):
    order_id: str


class ShipRefused(Event, type="ut.saga.shipping.refused"):
    order_id: str


class Shipped(Event, type="ut.saga.shipping.shipped_foreign"):
    """A foreign producer's reply: no order_id field, matched by the message key."""

    tracking: str


class OrderSaga(Saga, name="ut.order", start=OrderPlaced, key="order_id", abort=OrderCancelled):
    """DESIGN section 5's order saga: reserve, charge, ship."""

    order_id: str = ""
    sku: str = ""
    qty: int = 0
    amount: int = 0
    charge_id: str | None = None

    def started(self, e: OrderPlaced) -> None:
        self.order_id, self.sku, self.qty, self.amount = e.order_id, e.sku, e.qty, e.amount

    @step(reply=StockReserved, reject=StockRejected, timeout=30.0)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id, sku=self.sku, qty=self.qty)

    @reserve.compensate
    def release(self) -> Event:
        return ReleaseStock(order_id=self.order_id)

    @step(reply=PaymentCharged, reject=PaymentDeclined, timeout=30.0)
    def charge(self) -> Event:
        return ChargePayment(order_id=self.order_id, amount=self.amount)

    @charge.on_reply
    def _charged(self, e: PaymentCharged) -> None:
        self.charge_id = e.charge_id

    @charge.compensate
    def refund(self) -> Event:
        return RefundPayment(order_id=self.order_id, charge_id=self.charge_id)

    @step(reply=OrderShipped, timeout=60.0)
    def ship(self) -> Event:
        return ShipOrder(order_id=self.order_id)


class RefundSaga(Saga, name="ut.refund", start=OrderPlaced, key="order_id"):
    """The refund is waited for (reply=, timeout=) before the stock is released."""

    order_id: str = ""

    def started(self, e: OrderPlaced) -> None:
        self.order_id = e.order_id

    @step(reply=StockReserved, timeout=30.0)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id, sku="s", qty=1)

    @reserve.compensate
    def release(self) -> Event:
        return ReleaseStock(order_id=self.order_id)

    @step(reply=PaymentCharged, timeout=30.0)
    def charge(self) -> Event:
        return ChargePayment(order_id=self.order_id, amount=1)

    @charge.compensate(reply=PaymentRefunded, timeout=10.0)
    def refund(self) -> Event:
        return RefundPayment(order_id=self.order_id, charge_id=None)

    @step(reply=OrderShipped, timeout=5.0)
    def ship(self) -> Event:
        return ShipOrder(order_id=self.order_id)


class PivotSaga(Saga, name="ut.pivot", start=OrderPlaced, key="order_id", abort=OrderCancelled):
    """Past the charge (the pivot) shipping only goes forward: 3 attempts, 2 s then 4 s."""

    order_id: str = ""

    def started(self, e: OrderPlaced) -> None:
        self.order_id = e.order_id

    @step(reply=StockReserved, reject=StockRejected, timeout=30.0)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id, sku="s", qty=1)

    @reserve.compensate
    def release(self) -> Event:
        return ReleaseStock(order_id=self.order_id)

    @step(reply=PaymentCharged, reject=PaymentDeclined, timeout=30.0, pivot=True)
    def charge(self) -> Event:
        return ChargePayment(order_id=self.order_id, amount=1)

    @step(reply=OrderShipped | Shipped, reject=ShipRefused, timeout=10.0, retry=3, retry_delay=2.0)
    def ship(self) -> Event:
        return ShipOrder(order_id=self.order_id)


def ids(sent: list[Sent]) -> list[str]:
    return [s.id for s in sent]


def types_of(sent: list[Sent] | tuple[Sent, ...]) -> list[str]:
    return [type(s.event).__name__ for s in sent]


async def started(cls: type[Saga] = OrderSaga, order_id: str = "o-1") -> SagaTest[Saga]:
    t: SagaTest[Saga] = SagaTest(cls)
    await t.given(OrderPlaced(order_id=order_id))
    return t


# -- the order saga ------------------------------------------------------------------------


async def test_success_sends_each_step_and_completes() -> None:
    t = SagaTest(OrderSaga)
    first = await t.given(OrderPlaced(order_id="o-1", sku="s-9", qty=3, amount=250))
    assert first.kinds == ["started", "command-sent"]
    t.then_sent(ReserveStock(order_id="o-1", sku="s-9", qty=3)).then_waiting("reserve")
    assert t.timers == {"step:reserve": 30.0}
    await t.when_reply(StockReserved(order_id="o-1"))
    t.then_sent(ReserveStock, ChargePayment(order_id="o-1", amount=250))
    assert t.timers == {"step:charge": 30.0}
    await t.when_reply(PaymentCharged(order_id="o-1", charge_id="ch-1"))
    assert t.saga.charge_id == "ch-1"
    done = await t.when_reply(OrderShipped(order_id="o-1"))
    t.then_sent(ReserveStock, ChargePayment, ShipOrder).then_status("completed")
    assert done.kinds == ["replied", "completed"]
    assert t.timers == {}
    assert [s.step for s in t.sent] == ["reserve", "charge", "ship"]
    assert {(s.kind, s.attempt) for s in t.sent} == {("command", 1)}
    saga = t.saga
    assert (saga.id, saga.key, saga.status, saga.reason) == (
        "saga-ut.order-o-1",
        "o-1",
        "completed",
        None,
    )
    assert [h.kind for h in saga.history] == [
        "started",
        "command-sent",
        "replied",
        "command-sent",
        "replied",
        "command-sent",
        "replied",
        "completed",
    ]


async def test_payment_declined_releases_the_stock() -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    last = await t.when_reply(PaymentDeclined(order_id="o-1"))
    t.then_status("compensated", reason="charge rejected").then_sent(
        ReserveStock, ChargePayment, ReleaseStock
    )
    assert last.kinds == ["rejected", "compensating", "compensation-sent", "compensated"]
    assert (t.sent[-1].kind, t.sent[-1].step) == ("compensation", "reserve")
    assert t.timers == {}


async def test_shipping_timing_out_refunds_then_releases() -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.when_reply(PaymentCharged(order_id="o-1", charge_id="ch-1"))
    assert await t.advance(59.9) == []
    t.then_status("running").then_waiting("ship")
    (fired,) = await t.advance(0.1)
    assert fired.input == "timer step:ship"
    assert fired.kinds == [
        "timed-out",
        "compensating",
        "compensation-sent",
        "compensation-sent",
        "compensated",
    ]
    t.then_status("compensated", reason="ship timed out")
    t.then_sent(
        ReserveStock,
        ChargePayment,
        ShipOrder,
        RefundPayment(order_id="o-1", charge_id="ch-1"),
        ReleaseStock,
    )
    assert t.elapsed == 60.0
    assert fired.transitions[0].at == datetime(2026, 1, 1, 0, 1, tzinfo=UTC)


async def test_stock_rejected_compensates_nothing() -> None:
    t = await started()
    await t.when_reply(StockRejected(order_id="o-1"))
    t.then_status("compensated", reason="reserve rejected").then_sent(ReserveStock)


async def test_a_timed_out_step_is_compensated_without_its_reply_data() -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.elapse("step:charge")
    t.then_status("compensated").then_sent(
        ReserveStock,
        ChargePayment,
        RefundPayment(order_id="o-1", charge_id=None),  # its command may have taken effect
        ReleaseStock,
    )


async def test_a_second_start_event_starts_nothing() -> None:
    t = await started()
    applied = await t.when(OrderPlaced(order_id="o-1", qty=99))
    assert applied.kinds == ["ignored"] and applied.sent == ()
    t.then_recorded("ignored", detail="a second ut.saga.order.placed for o-1: starts nothing")
    assert t.saga.qty == 1
    t.then_waiting("reserve")


# -- compensations with a reply ------------------------------------------------------------


async def _refund_waiting() -> SagaTest[Saga]:
    t = await started(RefundSaga)
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.when_reply(PaymentCharged(order_id="o-1", charge_id="ch-1"))
    await t.elapse("step:ship")
    return t


async def test_a_compensation_with_a_reply_is_waited_for_before_the_next() -> None:
    t = await _refund_waiting()
    t.then_status("compensating").then_waiting("charge", "undo")
    t.then_sent(ReserveStock, ChargePayment, ShipOrder, RefundPayment)  # no release yet
    assert t.timers == {"step:charge": 10.0}
    assert "compensation refund of step charge waits for PaymentRefunded" in t.waits_for
    last = await t.when_reply(PaymentRefunded(order_id="o-1"))
    assert last.kinds == ["compensated", "compensation-sent", "compensated"]
    t.then_sent(ReserveStock, ChargePayment, ShipOrder, RefundPayment, ReleaseStock)
    t.then_status("compensated")


async def test_a_compensation_without_its_reply_in_time_fails_the_saga() -> None:
    t = await _refund_waiting()
    assert await t.advance(9.0) == []
    (fired,) = await t.advance(1.0)
    assert fired.kinds == ["timed-out", "failed"]
    t.then_status("failed", reason="compensation refund got no reply within 10.0s")
    resume = t.control.resume
    assert resume is not None
    assert (resume.step, resume.action, resume.reason) == ("charge", "undo", "ship timed out")
    assert "waits for a person" in t.waits_for
    assert t.timers == {}
    await t.advance(3600.0)  # nothing more happens by itself
    t.then_status("failed").then_sent(ReserveStock, ChargePayment, ShipOrder, RefundPayment)


async def test_retry_issues_the_failed_compensation_again_under_a_new_id() -> None:
    t = await _refund_waiting()
    await t.elapse("step:charge")
    t.then_status("failed")
    retried = await t.retry(by="ana")
    assert retried.kinds == ["retried", "compensation-sent"]
    assert retried.transitions[0].by == "ana"
    first, again = t.sent[3], t.sent[4]
    assert type(again.event) is RefundPayment and (first.attempt, again.attempt) == (1, 2)
    assert first.id != again.id
    t.then_status("compensating").then_waiting("charge", "undo")
    # The first attempt's reply, late, answers an earlier command: ignored.
    late = await t.when_reply(PaymentRefunded(order_id="o-1"), to=first)
    assert late.kinds == ["ignored"]
    assert f"answers an earlier command ({first.id})" in late.transitions[0].detail
    await t.when_reply(PaymentRefunded(order_id="o-1"))
    t.then_status("compensated").then_sent(
        ReserveStock, ChargePayment, ShipOrder, RefundPayment, RefundPayment, ReleaseStock
    )


async def test_skip_goes_on_past_the_failed_compensation() -> None:
    t = await _refund_waiting()
    await t.elapse("step:charge")
    skipped = await t.skip(by="bo")
    assert skipped.kinds == ["skipped", "compensation-sent", "compensated"]
    assert skipped.transitions[0].by == "bo"
    t.then_status("compensated").then_sent(
        ReserveStock, ChargePayment, ShipOrder, RefundPayment, ReleaseStock
    )
    t.then_recorded("skipped", step="charge", detail="undo handled by hand")


async def test_retry_and_skip_of_a_saga_that_is_not_failed_are_recorded_as_ignored() -> None:
    t = await started()
    for act in (t.retry(by="ana"), t.skip(by="ana")):
        applied = await act
        assert applied.kinds == ["ignored"] and applied.sent == ()
    t.then_recorded("ignored", detail="retry of a saga that is running: only a failed saga")
    t.then_recorded("ignored", detail="skip of a saga that is running: only a failed saga")
    t.then_waiting("reserve")


# -- the pivot -----------------------------------------------------------------------------


async def _past_the_pivot() -> SagaTest[Saga]:
    t = await started(PivotSaga)
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.when_reply(PaymentCharged(order_id="o-1", charge_id="ch-1"))
    return t


async def test_a_step_past_the_pivot_is_retried_with_backoff_then_succeeds() -> None:
    t = await _past_the_pivot()
    rejected = await t.when_reply(ShipRefused(order_id="o-1"))
    assert rejected.kinds == ["rejected", "retry-scheduled"]
    assert t.timers == {"retry:ship": 2.0}
    t.then_waiting("ship", "retry")
    assert "waits for its attempt 2, due in 2s" in t.waits_for
    assert await t.advance(1.9) == []
    (resent,) = await t.advance(0.1)
    assert types_of(resent.sent) == ["ShipOrder"] and resent.sent[0].attempt == 2
    await t.when_reply(ShipRefused(order_id="o-1"))
    assert t.timers == {"retry:ship": 4.0}  # doubled
    await t.advance(4.0)
    await t.when_reply(OrderShipped(order_id="o-1"))
    t.then_status("completed").then_sent(
        ReserveStock, ChargePayment, ShipOrder, ShipOrder, ShipOrder
    )
    ships = t.sent[2:]
    assert [s.attempt for s in ships] == [1, 2, 3]
    assert len(set(ids(ships))) == 3  # a new command id per attempt
    assert not any(h.kind.startswith("compensat") for h in t.history)


async def test_a_timeout_past_the_pivot_is_retried_too() -> None:
    t = await _past_the_pivot()
    fired = await t.advance(12.0)  # the deadline at 10 s, the retry at 12 s
    assert [a.input for a in fired] == ["timer step:ship", "timer retry:ship"]
    assert fired[0].kinds == ["timed-out", "retry-scheduled"]
    assert types_of(fired[1].sent) == ["ShipOrder"]
    assert t.timers == {"step:ship": 10.0}


async def test_out_of_attempts_past_the_pivot_fails_and_retry_resumes() -> None:
    t = await _past_the_pivot()
    await t.when_reply(ShipRefused(order_id="o-1"))
    await t.advance(2.0)
    await t.when_reply(ShipRefused(order_id="o-1"))
    await t.advance(4.0)
    last = await t.when_reply(ShipRefused(order_id="o-1"))
    assert last.kinds == ["rejected", "failed"]
    t.then_status("failed", reason="out of its 3 attempts past the pivot")
    assert t.timers == {}
    with pytest.raises(SagaTestError, match="waits for a person"):
        await t.when_reply(OrderShipped(order_id="o-1"))
    retried = await t.retry(by="ana")
    assert retried.kinds == ["retried", "command-sent"]
    assert t.sent[-1].attempt == 4 and t.sent[-1].id not in ids(t.sent[:-1])
    t.then_status("running").then_waiting("ship")
    await t.when_reply(OrderShipped(order_id="o-1"))
    t.then_status("completed")
    assert not any(h.kind.startswith("compensat") for h in t.history)


async def test_skip_past_the_pivot_goes_on_as_if_the_step_was_done() -> None:
    t = await _past_the_pivot()
    for delay in (2.0, 4.0, 0.0):
        await t.when_reply(ShipRefused(order_id="o-1"))
        await t.advance(delay)
    t.then_status("failed")
    await t.skip(by="ana")
    t.then_status("completed").then_recorded("skipped", step="ship", detail="do handled by hand")


async def test_a_rejected_pivot_compensates_what_came_before() -> None:
    t = await started(PivotSaga)
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.when_reply(PaymentDeclined(order_id="o-1"))
    t.then_status("compensated").then_sent(ReserveStock, ChargePayment, ReleaseStock)


async def test_a_foreign_reply_is_matched_by_the_message_key() -> None:
    t = await _past_the_pivot()
    applied = await t.when(Shipped(tracking="t-1"))  # no causation id, no key field
    assert applied.kinds == ["replied", "completed"]
    assert applied.transitions[0].detail == "ut.saga.shipping.shipped_foreign"


# -- abort ---------------------------------------------------------------------------------


async def test_an_abort_in_flight_waits_for_the_steps_reply_then_compensates_it() -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    aborted = await t.when(OrderCancelled(order_id="o-1"))
    # The charge's command is out: nothing goes forward, nothing is undone yet.
    assert aborted.kinds == ["aborted", "compensating"]
    assert aborted.sent == () and "step:charge" not in aborted.timers_cancelled
    t.then_status("compensating", reason="aborted by ut.saga.order.cancelled")
    t.then_waiting("charge")
    replied = await t.when_reply(PaymentCharged(order_id="o-1", charge_id="ch-1"))
    assert replied.kinds == [
        "replied",
        "compensation-sent",
        "compensation-sent",
        "compensated",
    ]
    t.then_status("compensated", reason="aborted by ut.saga.order.cancelled")
    t.then_sent(  # compensated with the reply's data
        ReserveStock, ChargePayment, RefundPayment(order_id="o-1", charge_id="ch-1"), ReleaseStock
    )
    assert t.timers == {}
    # A second copy of the reply, late: the saga is over.
    late = await t.when(PaymentCharged(order_id="o-1", charge_id="ch-1"), causation_id=t.sent[1].id)
    assert late.kinds == ["ignored"] and "already compensated" in late.transitions[0].detail


async def test_an_abort_in_flight_then_a_rejection_does_not_compensate_the_step() -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.when(OrderCancelled(order_id="o-1"))
    await t.when_reply(PaymentDeclined(order_id="o-1"))
    t.then_status("compensated", reason="aborted by").then_sent(
        ReserveStock, ChargePayment, ReleaseStock
    )


async def test_an_abort_in_flight_then_the_deadline_compensates_the_step_without_data() -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.when(OrderCancelled(order_id="o-1"))
    (fired,) = await t.advance(30.0)
    assert fired.kinds == ["timed-out", "compensation-sent", "compensation-sent", "compensated"]
    t.then_status("compensated", reason="aborted by").then_sent(
        ReserveStock, ChargePayment, RefundPayment(order_id="o-1", charge_id=None), ReleaseStock
    )


async def test_abort_by_a_person_is_recorded_with_the_name() -> None:
    t = await started()
    aborted = await t.abort(by="ana", reason="customer called")
    assert aborted.transitions[0].kind == "aborted"
    assert (aborted.transitions[0].detail, aborted.transitions[0].by) == ("customer called", "ana")
    t.then_status("compensating", reason="customer called").then_waiting("reserve")
    await t.when_reply(StockReserved(order_id="o-1"))
    t.then_status("compensated", reason="customer called").then_sent(ReserveStock, ReleaseStock)


async def test_abort_after_the_pivot_is_ignored_and_recorded() -> None:
    t = await _past_the_pivot()
    by_event = await t.when(OrderCancelled(order_id="o-1"))
    by_person = await t.abort(by="ana")
    for applied in (by_event, by_person):
        assert applied.kinds == ["ignored"] and applied.sent == ()
        assert "it is past its pivot step and only goes forward" in applied.transitions[0].detail
    t.then_status("running").then_waiting("ship")
    assert t.timers == {"step:ship": 10.0}


async def test_abort_of_a_finished_or_compensating_saga_is_ignored() -> None:
    t = await started()
    await t.when_reply(StockRejected(order_id="o-1"))
    applied = await t.when(OrderCancelled(order_id="o-1"))
    assert (
        applied.kinds == ["ignored"]
        and "compensated: nothing to abort" in applied.transitions[0].detail
    )
    r = await _refund_waiting()  # compensating, waiting for the refund
    applied = await r.abort(by="ana")
    assert (
        applied.kinds == ["ignored"]
        and "it is already compensating" in applied.transitions[0].detail
    )
    r.then_waiting("charge", "undo")


class Remind(Event, type="ut.saga.remind"):
    order_id: str
    n: int


class Ask(Event, type="ut.saga.ask"):
    order_id: str


class Answered(Event, type="ut.saga.answered"):
    order_id: str
    later: bool = False


class Deliver(Event, type="ut.saga.deliver"):
    order_id: str


class Delivered(Event, type="ut.saga.delivered"):
    order_id: str


class ReminderSaga(Saga, name="ut.reminder", start=OrderPlaced, key="order_id"):
    """Reminds every 60 s (three times at most) until answered; an answer of "later"
    reschedules the reminder to 120 s, any other answer cancels it."""

    order_id: str = ""
    reminders: int = 0

    def started(self, e: OrderPlaced) -> None:
        self.order_id = e.order_id
        self.set_timer("reminder", 60.0)

    @step(reply=Answered, timeout=500.0)
    def ask(self) -> Event:
        return Ask(order_id=self.order_id)

    @ask.on_reply
    def _answered(self, e: Answered) -> None:
        if e.later:
            self.set_timer("reminder", 120.0)
        else:
            self.cancel_timer("reminder")

    @step(reply=Delivered)
    def deliver(self) -> Event:
        return Deliver(order_id=self.order_id)

    @on_timer("reminder")
    def _remind(self) -> Event:
        self.reminders += 1
        if self.reminders < 3:
            self.set_timer("reminder", 60.0)
        return Remind(order_id=self.order_id, n=self.reminders)


# -- named timers --------------------------------------------------------------------------


async def test_a_named_timer_is_set_and_fires_with_its_method() -> None:
    t = await started(ReminderSaga)
    assert t.timers == {"reminder": 60.0, "step:ask": 500.0}
    t.then_recorded("timer-set", detail="reminder in 60s")
    (fired,) = await t.advance(60.0)
    assert fired.kinds == ["timer-fired", "timer-set"]
    (message,) = fired.sent
    assert (message.kind, message.event) == ("message", Remind(order_id="o-1", n=1))
    assert message.envelope.key == "o-1"
    assert t.saga.reminders == 1


async def test_timers_fire_in_due_order_within_one_advance() -> None:
    t = await started(ReminderSaga)
    fired = await t.advance(1000.0)
    assert [(a.input, a.transitions[0].at.timestamp() - 1_767_225_600) for a in fired] == [
        ("timer reminder", 60.0),
        ("timer reminder", 120.0),
        ("timer reminder", 180.0),
        ("timer step:ask", 500.0),
    ]
    assert [s.event.n for s in t.sent if isinstance(s.event, Remind)] == [1, 2, 3]
    t.then_status("compensated", reason="ask timed out")
    assert t.elapsed == 1000.0


async def test_a_rescheduled_timer_fires_at_its_new_time_only() -> None:
    t = await started(ReminderSaga)
    await t.advance(30.0)
    later = await t.when_reply(Answered(order_id="o-1", later=True))
    assert later.timers_set == {"reminder": 120.0}
    assert t.timers == {"reminder": 120.0}
    assert await t.advance(119.0) == []  # the old setting (due at 60 s) fires nothing
    stale = await t.fire_stale("reminder")  # as a timer loop that read it before would
    assert stale.kinds == ["ignored"] and stale.sent == ()
    assert "fired after it was cancelled or rescheduled" in stale.transitions[0].detail
    assert t.timers == {"reminder": 1.0}
    (fired,) = await t.advance(1.0)
    assert fired.kinds[0] == "timer-fired" and t.saga.reminders == 1


async def test_a_cancelled_timer_never_fires() -> None:
    t = await started(ReminderSaga)
    answered = await t.when_reply(Answered(order_id="o-1"))
    assert "timer-cancelled" in answered.kinds and "reminder" in answered.timers_cancelled
    assert t.timers == {}
    assert await t.advance(10_000.0) == []
    stale = await t.fire_stale("reminder")
    assert stale.kinds == ["ignored"]
    t.then_status("running").then_waiting("deliver")
    assert t.saga.reminders == 0
    assert not any(isinstance(s.event, Remind) for s in t.sent)
    with pytest.raises(SagaTestError, match="has no rescheduled or cancelled setting"):
        await t.fire_stale("reminder")


async def test_a_timer_for_a_finished_saga_changes_nothing() -> None:
    t = await started(ReminderSaga)
    await t.when_reply(Answered(order_id="o-1", later=True))
    await t.when_reply(Delivered(order_id="o-1"))
    t.then_status("completed")
    assert t.timers == {}  # ending cancels every timer
    stale = await t.fire_stale("reminder")
    assert stale.kinds == ["ignored"] and t.saga.reminders == 0


# -- late and stray inputs -----------------------------------------------------------------


async def test_a_late_reply_to_an_earlier_command_is_recorded_as_ignored() -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    duplicate = await t.when_reply(StockReserved(order_id="o-1"), to=t.sent[0])
    assert duplicate.kinds == ["ignored"]
    assert duplicate.transitions[0].step == "charge"
    assert f"answers an earlier command ({t.sent[0].id})" in duplicate.transitions[0].detail
    t.then_waiting("charge").then_sent(ReserveStock, ChargePayment)


async def test_past_the_pivot_a_late_success_of_an_earlier_attempt_is_the_success() -> None:
    t = await _past_the_pivot()
    await t.when_reply(ShipRefused(order_id="o-1"))
    await t.advance(2.0)
    first, second = t.sent[2], t.sent[3]
    assert (first.attempt, second.attempt) == (1, 2)
    late = await t.when_reply(OrderShipped(order_id="o-1"), to=first)
    assert late.kinds == ["replied", "completed"]
    assert late.transitions[0].detail == "ut.saga.shipping.shipped (to attempt 1)"
    assert "step:ship" in late.timers_cancelled
    t.then_status("completed").then_sent(ReserveStock, ChargePayment, ShipOrder, ShipOrder)
    again = await t.when_reply(OrderShipped(order_id="o-1"), to=second)
    assert again.kinds == ["ignored"] and "already completed" in again.transitions[0].detail


async def test_past_the_pivot_a_late_success_during_the_backoff_cancels_the_retry() -> None:
    t = await _past_the_pivot()
    timed_out = await t.advance(10.0)  # attempt 1 times out: the backoff starts
    assert timed_out[0].kinds == ["timed-out", "retry-scheduled"]
    t.then_waiting("ship", "retry")
    late = await t.when_reply(OrderShipped(order_id="o-1"), to=t.sent[2])
    assert late.kinds == ["replied", "completed"] and "retry:ship" in late.timers_cancelled
    assert await t.advance(60.0) == []  # no second attempt
    t.then_status("completed").then_sent(ReserveStock, ChargePayment, ShipOrder)


async def test_past_the_pivot_a_late_rejection_of_an_earlier_attempt_changes_nothing() -> None:
    t = await _past_the_pivot()
    await t.advance(12.0)  # attempt 1 timed out, attempt 2 sent
    first = t.sent[2]
    late = await t.when_reply(ShipRefused(order_id="o-1"), to=first)
    assert late.kinds == ["ignored"] and "an earlier command" in late.transitions[0].detail
    t.then_waiting("ship")
    assert t.timers == {"step:ship": 10.0}
    during = await t.advance(10.0)  # attempt 2 times out: its backoff
    assert during[0].kinds == ["timed-out", "retry-scheduled"]
    rejected = await t.when_reply(ShipRefused(order_id="o-1"), to=t.sent[3])
    assert rejected.kinds == ["ignored"]  # the attempt that timed out, rejected late
    assert "waits for its backoff" in rejected.transitions[0].detail
    t.then_waiting("ship", "retry")


async def test_a_reply_for_a_finished_saga_is_ignored() -> None:
    t = await started()
    await t.when_reply(StockRejected(order_id="o-1"))
    applied = await t.when(StockReserved(order_id="o-1"), causation_id=t.sent[0].id)
    assert applied.kinds == ["ignored"]
    assert "for a saga already compensated" in applied.transitions[0].detail
    t.then_status("compensated").then_sent(ReserveStock)


async def test_a_reply_that_answers_another_step_is_ignored() -> None:
    t = await started()
    applied = await t.when(PaymentCharged(order_id="o-1", charge_id="c"))
    assert applied.kinds == ["ignored"]
    assert "does not answer step reserve" in applied.transitions[0].detail
    t.then_waiting("reserve")


# -- local and async steps -----------------------------------------------------------------


class Priced(Event, type="ut.saga.priced"):
    order_id: str
    price: int


class LocalAsyncSaga(Saga, name="ut.localasync", start=OrderPlaced, key="order_id"):
    order_id: str = ""
    price: int = 0
    confirmed: bool = False
    notes: list[str] = []

    async def started(self, e: OrderPlaced) -> None:
        await asyncio.sleep(0)
        self.order_id = e.order_id

    @step()
    def price_it(self) -> None:  # a local step: done at once
        self.price = 42
        self.notes.append("priced")

    @step(reply=PaymentCharged, timeout=5.0)
    async def charge(self) -> Event:
        await asyncio.sleep(0)
        return ChargePayment(order_id=self.order_id, amount=self.price)

    @charge.on_reply
    async def _charged(self, e: PaymentCharged) -> None:
        await asyncio.sleep(0)
        self.notes.append(e.charge_id)

    @step()
    def notify(self) -> Event:  # no reply=: done once sent
        return Priced(order_id=self.order_id, price=self.price)

    @step()
    async def confirm(self) -> None:
        self.confirmed = True


async def test_local_and_async_steps() -> None:
    t = await started(LocalAsyncSaga)
    assert t.last.kinds == ["started", "step-done", "command-sent"]
    t.then_sent(ChargePayment(order_id="o-1", amount=42)).then_waiting("charge")
    await t.when_reply(PaymentCharged(order_id="o-1", charge_id="ch-9"))
    assert t.last.kinds == ["replied", "command-sent", "step-done", "completed"]
    t.then_status("completed").then_sent(ChargePayment, Priced(order_id="o-1", price=42))
    saga = t.saga
    assert (saga.price, saga.confirmed, saga.notes) == (42, True, ["priced", "ch-9"])


# -- command ids ---------------------------------------------------------------------------


async def _a_run(start: float | None = None) -> list[str]:
    t = SagaTest(PivotSaga) if start is None else SagaTest(PivotSaga, start=start)
    await t.given(OrderPlaced(order_id="o-1"))
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.when_reply(PaymentCharged(order_id="o-1", charge_id="c"))
    await t.when_reply(ShipRefused(order_id="o-1"))
    await t.advance(2.0)
    return ids(t.sent)


async def test_command_ids_are_deterministic_and_differ_per_attempt() -> None:
    one, two = await _a_run(), await _a_run()
    assert one == two and len(one) == 4
    assert len(set(one)) == 4  # reserve, charge, ship attempt 1, ship attempt 2
    assert await _a_run(start=1_800_000_000.0) != one  # another saga of the same key
    t = await started()
    assert t.sent[0].envelope.id == t.sent[0].id
    assert t.sent[0].envelope.key == "o-1"
    assert t.sent[0].envelope.type == "ut.saga.stock.reserve"
    # Commands continue the start event's correlation and are caused by their input.
    assert t.sent[0].envelope.correlation_id == t.applied[0].message_id
    assert t.sent[0].envelope.causation_id == t.applied[0].message_id


# -- the reload round trip -----------------------------------------------------------------


async def test_state_survives_the_reload_round_trip() -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    await t.when_reply(PaymentCharged(order_id="o-1", charge_id="ch-1"))
    await t.elapse("step:ship")
    # The charge id copied in on_reply, two inputs ago, reached the refund after reloads.
    t.then_sent(
        ReserveStock,
        ChargePayment,
        ShipOrder,
        RefundPayment(order_id="o-1", charge_id="ch-1"),
        ReleaseStock,
    )
    a, b = t.saga, t.saga
    assert a is not b and a.model_dump() == b.model_dump()
    a.charge_id = "changed"
    assert t.saga.charge_id == "ch-1"  # .saga is a fresh copy


class Leaky(Saga, name="ut.leaky", start=OrderPlaced, key="order_id"):
    order_id: str = ""
    qty: int = 0
    seen: tuple[str, ...] = ()

    def started(self, e: OrderPlaced) -> None:
        self.order_id = e.order_id
        if e.sku == "wrong-type":
            self.qty = str(e.qty)  # type: ignore[assignment]
        elif e.sku == "list-for-tuple":
            self.seen = ["a"]  # type: ignore[assignment]
        elif e.sku == "not-json":
            self.seen = (object(),)  # type: ignore[assignment]

    @step(reply=StockReserved)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id, sku="s", qty=self.qty)


@pytest.mark.parametrize(
    ("sku", "match"),
    [
        ("wrong-type", r"Leaky.qty = '1' reads back as 1 after a reload"),
        ("list-for-tuple", r"Leaky.seen = \['a'\] reads back as \('a',\) after a reload"),
        ("not-json", r"Leaky's state (cannot be saved|would not load back)"),
    ],
)
async def test_state_that_would_not_survive_a_reload_fails_the_test(sku: str, match: str) -> None:
    t = SagaTest(Leaky)
    with pytest.raises(SagaTestError, match=match):
        await t.given(OrderPlaced(order_id="o-1", sku=sku))
    assert not t.started


async def test_a_saga_with_sound_state_passes_the_round_trip() -> None:
    t = SagaTest(Leaky)
    await t.given(OrderPlaced(order_id="o-1", sku="fine"))
    t.then_sent(ReserveStock(order_id="o-1", sku="s", qty=0))


# -- abort from saga methods ---------------------------------------------------------------


class SelfAborting(Saga, name="ut.selfabort", start=OrderPlaced, key="order_id"):
    """Aborts from the charge step when the amount is too large (the step's command must not
    be sent) and from the reservation's reply when too little stock is left (the reserved
    stock must be released)."""

    order_id: str = ""
    amount: int = 0
    local: bool = False

    def started(self, e: OrderPlaced) -> None:
        self.order_id, self.amount, self.local = e.order_id, e.amount, e.sku == "local"

    @step(reply=StockReserved, timeout=30.0)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id, sku="s", qty=1)

    @reserve.on_reply
    def _reserved(self, e: StockReserved) -> None:
        if e.left < 0:
            self.abort("oversold")

    @reserve.compensate
    def release(self) -> Event:
        return ReleaseStock(order_id=self.order_id)

    @step(reply=PaymentCharged, timeout=30.0)
    def charge(self) -> Event | None:
        if self.amount > 1000:
            self.abort("amount too large")
            if self.local:
                return None
        return ChargePayment(order_id=self.order_id, amount=self.amount)


@pytest.mark.parametrize("sku", ["command", "local"])
async def test_an_abort_from_a_step_method_sends_not_its_command(sku: str) -> None:
    t = SagaTest(SelfAborting)
    await t.given(OrderPlaced(order_id="o-1", sku=sku, amount=5000))
    last = await t.when_reply(StockReserved(order_id="o-1"))
    assert last.kinds == ["replied", "aborted", "compensating", "compensation-sent", "compensated"]
    t.then_status("compensated", reason="amount too large").then_sent(ReserveStock, ReleaseStock)
    assert t.control.done == ["reserve"]


async def test_an_abort_from_on_reply_compensates_the_replied_step() -> None:
    t = SagaTest(SelfAborting)
    await t.given(OrderPlaced(order_id="o-1"))
    await t.when_reply(StockReserved(order_id="o-1", left=-1))
    t.then_status("compensated", reason="oversold").then_sent(ReserveStock, ReleaseStock)


# -- async compensations and timer methods ---------------------------------------------------


class AsyncUndo(Saga, name="ut.asyncundo", start=OrderPlaced, key="order_id"):
    order_id: str = ""

    def started(self, e: OrderPlaced) -> None:
        self.order_id = e.order_id
        self.set_timer("give_up", 10.0)

    @step(reply=StockReserved, timeout=30.0)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id, sku="s", qty=1)

    @reserve.compensate(reply=PaymentRefunded, timeout=5.0)
    async def release(self) -> Event:
        await asyncio.sleep(0)
        return ReleaseStock(order_id=self.order_id)

    @on_timer("give_up")
    async def _give_up(self) -> Event:
        await asyncio.sleep(0)
        self.abort("gave up")
        return Remind(order_id=self.order_id, n=0)


async def test_async_compensations_and_timer_methods() -> None:
    t = await started(AsyncUndo)
    (fired,) = await t.advance(10.0)
    assert fired.kinds == ["timer-fired", "aborted", "compensating"]
    assert types_of(fired.sent) == ["Remind"]  # the reservation is in flight: its outcome first
    t.then_status("compensating", reason="gave up").then_waiting("reserve")
    replied = await t.when_reply(StockReserved(order_id="o-1"))
    assert types_of(replied.sent) == ["ReleaseStock"]
    assert replied.sent[0].envelope.headers["eventflow-compensates"] == t.sent[0].id
    t.then_waiting("reserve", "undo")
    await t.when_reply(PaymentRefunded(order_id="o-1"))
    t.then_status("compensated")


# -- the kit agrees with the runtime ---------------------------------------------------------


def _participants(decline: bool) -> list[object]:
    @subscribe(ReserveStock.event_type, group="ut.kit.inventory")
    async def reserve(cmd: ReserveStock, ctx: Context) -> None:
        await ctx.publish(StockReserved(order_id=cmd.order_id))

    @subscribe(ChargePayment.event_type, group="ut.kit.payment")
    async def charge(cmd: ChargePayment, ctx: Context) -> None:
        if decline:
            await ctx.publish(PaymentDeclined(order_id=cmd.order_id))
        else:
            await ctx.publish(PaymentCharged(order_id=cmd.order_id, charge_id="ch-1"))

    @subscribe(ShipOrder.event_type, group="ut.kit.shipping")
    async def ship(cmd: ShipOrder, ctx: Context) -> None:
        await ctx.publish(OrderShipped(order_id=cmd.order_id))

    return [reserve, charge, ship]


@pytest.mark.parametrize("decline", [False, True], ids=["completed", "declined"])
async def test_the_kit_records_what_the_runtime_records(
    decline: bool, broker_url: str, waiter: Callable[..., Awaitable[None]]
) -> None:
    t = await started()
    await t.when_reply(StockReserved(order_id="o-1"))
    if decline:
        await t.when_reply(PaymentDeclined(order_id="o-1"))
    else:
        await t.when_reply(PaymentCharged(order_id="o-1", charge_id="ch-1"))
        await t.when_reply(OrderShipped(order_id="o-1"))
    app = App("ut-kit", broker=broker_url, handlers=_participants(decline), sagas=[OrderSaga])
    async with app:
        await app.publish(OrderPlaced(order_id="o-1"), key="o-1")

        async def ended() -> bool:
            saga = await app.sagas.get(OrderSaga, "o-1")
            return saga is not None and saga.status in ("completed", "compensated")

        await waiter(ended, what="the saga to end")
        real = await app.sagas.get(OrderSaga, "o-1")
    assert real is not None
    assert [(h.kind, h.step, h.detail) for h in real.history] == [
        (h.kind, h.step, h.detail) for h in t.history
    ]
    assert real.model_dump() == t.saga.model_dump()
    assert real.status == t.status == ("compensated" if decline else "completed")


# -- the kit's own errors ------------------------------------------------------------------


async def test_a_reply_while_nothing_waits_says_what_the_saga_waits_for() -> None:
    t = await _past_the_pivot()
    await t.when_reply(ShipRefused(order_id="o-1"))
    with pytest.raises(
        SagaTestError,
        match=r"OrderShipped replies to nothing: step ship waits "
        r"for its attempt 2, due in 2s: call \.advance",
    ):
        await t.when_reply(OrderShipped(order_id="o-1"))
    done = await started()
    await done.when_reply(StockRejected(order_id="o-1"))
    with pytest.raises(SagaTestError, match="the saga is compensated and waits for nothing"):
        await done.when_reply(StockReserved(order_id="o-1"))


async def test_a_reply_of_the_wrong_type_says_what_the_step_takes() -> None:
    t = await started()
    with pytest.raises(
        SagaTestError,
        match="PaymentCharged does not answer step reserve, which waits for StockReserved "
        r"\| StockRejected",
    ):
        await t.when_reply(PaymentCharged(order_id="o-1", charge_id="c"))
    t.then_waiting("reserve")  # nothing was applied
    assert len(t.applied) == 1


async def test_the_kit_refuses_what_cannot_happen() -> None:
    t = SagaTest(OrderSaga)
    with pytest.raises(SagaTestError, match=r"has not started: start it with \.given\(OrderPlaced"):
        await t.when_reply(StockReserved(order_id="o-1"))
    with pytest.raises(SagaTestError, match="starts with OrderPlaced, not StockReserved"):
        await t.given(StockReserved(order_id="o-1"))
    with pytest.raises(SagaTestError, match=r"OrderPlaced\.order_id is empty"):
        await t.given(OrderPlaced(order_id=""))
    await t.given(OrderPlaced(order_id="o-1"))
    with pytest.raises(SagaTestError, match="already started"):
        await t.given(OrderPlaced(order_id="o-1"))
    with pytest.raises(SagaTestError, match="for another saga than this one"):
        await t.when(StockReserved(order_id="o-2"))
    with pytest.raises(SagaTestError, match="takes no Remind"):
        await t.when(Remind(order_id="o-1", n=1))
    with pytest.raises(
        SagaTestError, match=r"timer reminder is not set; set timers: \{'step:reserve': 30.0\}"
    ):
        await t.elapse("reminder")
    with pytest.raises(SagaTestError, match="only goes forward"):
        await t.advance(-1.0)
    with pytest.raises(SagaTestError, match="takes a Saga subclass"):
        SagaTest(Saga)
    assert len(t.applied) == 1


class Runaway(Saga, name="ut.runaway", start=OrderPlaced, key="order_id"):
    order_id: str = ""

    def started(self, e: OrderPlaced) -> None:
        self.set_timer("again", 0.0)

    @step(reply=StockReserved)
    def reserve(self) -> Event:
        return ReserveStock(order_id="x", sku="s", qty=1)

    @on_timer("again")
    def _again(self) -> None:
        self.set_timer("again", 0.0)


async def test_a_timer_that_keeps_setting_itself_due_at_once_is_stopped() -> None:
    t = SagaTest(Runaway)
    await t.given(OrderPlaced(order_id="o-1"))
    with pytest.raises(SagaTestError, match="a timer keeps setting itself due at once"):
        await t.advance(1.0)


async def test_the_start_key_may_come_from_the_message_key() -> None:
    t = SagaTest(OrderSaga)
    await t.given(OrderPlaced(order_id=""), key="o-9")
    assert (t.saga.key, t.saga.id) == ("o-9", "saga-ut.order-o-9")
    assert t.sent[0].envelope.key == "o-9"


async def test_the_then_checks_fail_with_what_happened() -> None:
    t = await started()
    with pytest.raises(AssertionError, match=r"expected completed, the saga is running") as e:
        t.then_status("completed")
    assert "step reserve waits for StockReserved | StockRejected" in str(e.value)
    assert "+0s command-sent [reserve]" in str(e.value)
    with pytest.raises(AssertionError, match=r"expected sent: \[ReserveStock, ChargePayment\]"):
        t.then_sent(ReserveStock, ChargePayment)
    with pytest.raises(AssertionError, match="expected sent"):
        t.then_sent(ReserveStock(order_id="o-1", sku="other", qty=1))
    with pytest.raises(AssertionError, match="expected sent: \\[\\]"):
        t.then_sent()
    with pytest.raises(AssertionError, match=r"expected to wait on charge \(do\)"):
        t.then_waiting("charge")
    with pytest.raises(AssertionError, match="no completed transition"):
        t.then_recorded("completed")
    with pytest.raises(SagaTestError, match="status 'done'"):
        t.then_status("done")


# -- docs/saga-testing.md ------------------------------------------------------------------

DOC = Path(__file__).parents[2] / "docs" / "saga-testing.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


async def test_the_documented_example_runs() -> None:
    source = "\n".join(_BLOCK.findall(DOC.read_text()))
    assert "SagaTest(" in source
    module = types.ModuleType("saga_testing_doc")
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, str(DOC), "exec"), module.__dict__)
        tests = [v for k, v in vars(module).items() if k.startswith("test_") and callable(v)]
        assert len(tests) >= 3
        for test in tests:
            await test()
    finally:
        del sys.modules[module.__name__]
