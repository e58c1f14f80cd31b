"""Declaring sagas: what ``Saga``, ``@step``, ``.compensate``, ``.on_reply`` and ``@on_timer``
accept, and the errors that say what to fix."""

from __future__ import annotations

from typing import Any

import pytest

from eventflow import ConfigurationError, Event, Saga, on_timer, step
from eventflow.testing.sagas import SagaTest


class Begun(Event, type="ut.sagadef.begun"):
    order_id: str


class Cancelled(Event, type="ut.sagadef.cancelled"):
    order_id: str


class Do(Event, type="ut.sagadef.do"):
    order_id: str


class Done(Event, type="ut.sagadef.done"):
    order_id: str


class Refused(Event, type="ut.sagadef.refused"):
    order_id: str


class Busy(Event, type="ut.sagadef.busy"):
    order_id: str


class Undo(Event, type="ut.sagadef.undo"):
    order_id: str


class Undone(Event, type="ut.sagadef.undone"):
    order_id: str


class Plain(Event):  # no type=: not an event the saga can send or take
    x: int = 0


def _saga(name: str = "ut.sagadef.x", **kwargs: Any) -> dict[str, Any]:
    return {"name": name, "start": Begun, "key": "order_id", **kwargs}


# -- a good definition ------------------------------------------------------------------------


class Good(Saga, name="ut.sagadef.good", start=Begun, key="order_id", abort=Cancelled):
    order_id: str = ""

    @step(reply=Done, reject=Refused | Busy, timeout=5.0)
    def first(self) -> Event:
        return Do(order_id=self.order_id)

    @first.compensate(reply=Undone, timeout=3.0)
    def undo_first(self) -> Event:
        return Undo(order_id=self.order_id)

    @step(pivot=True)
    def local(self) -> None:
        return None

    @step(reply=Done, retry=2, retry_delay=0.5)
    def last(self) -> Event:
        return Do(order_id=self.order_id)

    @on_timer("nudge")
    def _nudge(self) -> None:
        return None


def test_a_definition_holds_what_the_class_declares() -> None:
    d = Good.definition
    assert (d.name, d.start, d.key, d.abort) == ("ut.sagadef.good", Begun, "order_id", (Cancelled,))
    assert [s.name for s in d.steps] == ["first", "local", "last"]
    first = d.step("first")
    assert first.reply == (Done,) and first.reject == (Refused, Busy) and first.timeout == 5.0
    assert first.compensation is not None
    assert first.compensation.name == "undo_first"
    assert (first.compensation.reply, first.compensation.timeout) == ((Undone,), 3.0)
    assert d.step("local").pivot and (d.step("last").retry, d.step("last").retry_delay) == (2, 0.5)
    assert d.timers == {"nudge": "_nudge"}
    assert d.stream_prefix == "saga-ut.sagadef.good-"
    assert {c.event_type for c in d.input_types()} == {
        "ut.sagadef.begun",
        "ut.sagadef.done",
        "ut.sagadef.refused",
        "ut.sagadef.busy",
        "ut.sagadef.undone",
        "ut.sagadef.cancelled",
    }
    with pytest.raises(KeyError):
        d.step("nope")


async def test_a_union_of_rejects_each_rejects() -> None:
    for rejection in (Refused, Busy):
        t = SagaTest(Good)
        await t.given(Begun(order_id="o-1"))
        await t.when_reply(rejection(order_id="o-1"))
        t.then_status("compensated").then_sent(Do).then_recorded("rejected", step="first")


# -- the saga class -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Order", "order saga", "1order", "", "order-x"])
def test_a_bad_saga_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="lowercase letters"):

        class _S(Saga, **_saga(name)):
            pass


def test_the_key_must_be_a_field_of_the_start_event() -> None:
    with pytest.raises(ConfigurationError, match=r"key='customer' must name a field of Begun"):

        class _S(Saga, **_saga(key="customer")):
            pass

    with pytest.raises(ConfigurationError, match="key=None"):

        class _T(Saga, name="ut.sagadef.nokey", start=Begun):
            pass


@pytest.mark.parametrize("start", [None, Plain, "ut.sagadef.begun", Begun(order_id="o")])
def test_start_must_be_an_event_class_with_a_type(start: object) -> None:
    with pytest.raises(ConfigurationError, match="needs start=<an Event class>"):

        class _S(Saga, **_saga(start=start)):
            pass


def test_abort_takes_event_classes() -> None:
    with pytest.raises(ConfigurationError, match="abort= takes Event classes"):

        class _S(Saga, **_saga(abort=Plain)):
            pass


def test_two_pivots_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"two pivot steps: \['a', 'b'\]"):

        class _S(Saga, **_saga()):
            @step(reply=Done, pivot=True)
            def a(self) -> Event:
                return Do(order_id="")

            @step(reply=Done, pivot=True)
            def b(self) -> Event:
                return Do(order_id="")


def test_a_compensation_after_the_pivot_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="step b comes after the pivot"):

        class _S(Saga, **_saga()):
            @step(reply=Done, pivot=True)
            def a(self) -> Event:
                return Do(order_id="")

            @step(reply=Done)
            def b(self) -> Event:
                return Do(order_id="")

            @b.compensate
            def undo_b(self) -> Event:
                return Undo(order_id="")


def test_the_pivot_itself_may_have_a_compensation() -> None:
    class _S(Saga, **_saga("ut.sagadef.pivotcomp")):
        @step(reply=Done, pivot=True)
        def a(self) -> Event:
            return Do(order_id="")

        @a.compensate
        def undo_a(self) -> Event:
            return Undo(order_id="")

    assert _S.definition.step("a").compensation is not None


# -- @step and its decorators ------------------------------------------------------------------


def test_reject_or_timeout_without_a_reply_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="needs reply=: what succeeds it"):
        step(reject=Refused)
    with pytest.raises(ConfigurationError, match="needs reply=: what succeeds it"):
        step(timeout=3.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reply": Done, "timeout": 0}, "must be positive seconds"),
        ({"reply": Done, "timeout": -1.0}, "must be positive seconds"),
        ({"reply": Done, "retry": 0}, "at least 1"),
        ({"reply": Plain}, r"step\(reply=\) takes Event classes"),
        ({"reply": Done, "reject": int}, r"step\(reject=\) takes Event classes"),
        ({"reply": Done, "retry_delay": -1.0}, "retry_delay"),
    ],
)
def test_step_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        step(**kwargs)


def test_compensate_with_a_reply_needs_a_timeout() -> None:
    s = step(reply=Done)(lambda self: None)
    with pytest.raises(ConfigurationError, match=r"compensate\(reply=...\) needs a timeout="):
        s.compensate(reply=Undone)


@pytest.mark.parametrize("timeout", [0, -2.0])
def test_a_compensation_timeout_must_be_positive(timeout: float) -> None:
    s = step(reply=Done)(lambda self: None)
    with pytest.raises(ConfigurationError, match="must be positive seconds"):
        s.compensate(reply=Undone, timeout=timeout)


def test_a_compensation_timeout_without_a_reply_is_refused() -> None:
    # Nothing would be waited for: the timeout would be ignored without a word.
    s = step(reply=Done)(lambda self: None)
    with pytest.raises(ConfigurationError, match=r"compensate\(timeout=...\) needs reply="):
        s.compensate(timeout=5.0)


def test_a_step_has_one_compensation_and_one_reply_handler() -> None:
    s = step(reply=Done)(lambda self: None)
    s.compensate(lambda self: None)
    with pytest.raises(ConfigurationError, match="two compensations"):
        s.compensate(lambda self: None)
    s.on_reply(lambda self, e: None)
    with pytest.raises(ConfigurationError, match="two on_reply"):
        s.on_reply(lambda self, e: None)


def test_on_reply_needs_a_reply() -> None:
    s = step()(lambda self: None)
    with pytest.raises(ConfigurationError, match="has no reply= to handle"):
        s.on_reply(lambda self, e: None)


# -- timers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "step:first", "retry:first"])
def test_reserved_or_empty_timer_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="timer name"):
        on_timer(name)


def test_two_timer_methods_for_one_name_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="two @on_timer"):

        class _S(Saga, **_saga()):
            @on_timer("nudge")
            def a(self) -> None: ...

            @on_timer("nudge")
            def b(self) -> None: ...


def test_only_declared_timers_can_be_set_or_cancelled() -> None:
    saga = Good()
    with pytest.raises(ConfigurationError, match=r"no @on_timer\('other'\)"):
        saga.set_timer("other", 1.0)
    # A step's deadline is the machine's: cancelling it from saga code would leave the step
    # waiting forever.
    with pytest.raises(ConfigurationError, match=r"no @on_timer\('step:first'\)"):
        saga.cancel_timer("step:first")
    saga.set_timer("nudge", 1.0)
    saga.cancel_timer("nudge")


# -- what steps return ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [("text", "oops", "'oops'"), ("class", Do, "<class "), ("number", 42, "42")],
)
async def test_a_step_returning_a_non_event_raises_type_error(
    name: str, value: object, shown: str
) -> None:
    class Bad(Saga, name=f"ut.sagadef.bad_{name}", start=Begun, key="order_id"):
        order_id: str = ""

        @step(reply=Done)
        def first(self) -> Any:
            return value

    t = SagaTest(Bad)
    with pytest.raises(TypeError) as raised:
        await t.given(Begun(order_id="o-1"))
    message = str(raised.value)
    assert f"saga ut.sagadef.bad_{name}: first returned {shown}" in message
    assert "a step returns the command (an Event instance) or None" in message
    assert not t.started  # nothing was saved: the input failed as a whole


async def test_a_timer_method_returning_a_non_event_fails_its_saga(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Timed(Saga, name="ut.sagadef.timed", start=Begun, key="order_id"):
        order_id: str = ""

        def started(self, e: Begun) -> None:
            self.set_timer("nudge", 5.0)

        @step(reply=Done)
        def first(self) -> Event:
            return Do(order_id=self.order_id)

        @on_timer("nudge")
        def _nudge(self) -> Any:
            return "not an event"

    t = SagaTest(Timed)
    await t.given(Begun(order_id="o-1"))
    (fired,) = await t.advance(5.0)  # contained to the saga: the timer loop goes on
    assert fired.kinds == ["failed"]
    t.then_status("failed", reason="_nudge returned 'not an event'; a timer method returns")
    assert "timer nudge of saga-ut.sagadef.timed-o-1 raised TypeError" in caplog.text
    t.then_waiting("first")  # what it waited for is kept for when a person resumes it
