"""Sagas and participants with deadlines and timers for the promise tests (issue 20).

A saga class whose timer code has a bug (:class:`BuggySaga`, :class:`UndoDeadlineSaga`), one
whose deadlines fire (:class:`TickingSaga`), and one step whose reply a stalled member of
the saga's group may hold (:class:`ParcelSaga`). Event types are ``promise.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eventflow import Context, Event, Saga, on_timer, step, subscribe

from .promises import Ledger

# -- timers: one saga class whose timer code has a bug, one whose deadlines fire -------------


class Watched(Event, type="promise.watch.started"):
    order_id: str


class Ask(Event, type="promise.watch.ask"):
    order_id: str


class Answered(Event, type="promise.watch.answered"):
    order_id: str


class Nudge(Event, type="promise.watch.nudge"):
    order_id: str


class Undo(Event, type="promise.watch.undo"):
    order_id: str


@dataclass
class Bug:
    """The bug in :class:`BuggySaga`'s code, until a person fixes it (``fixed``)."""

    fixed: bool = False


BUG = Bug()
"""The one switch :class:`BuggySaga` reads (a test sets it, and resets it after)."""
NUDGE_IN = 0.2
"""Seconds after its start a :class:`BuggySaga` is nudged."""
BUGGY_DEADLINE = 0.5
"""Seconds an :class:`UndoDeadlineSaga` waits for an answer that never comes."""


class BuggySaga(Saga, name="promise.buggy", start=Watched, key="order_id"):
    """Asks and waits; a timer (``nudge``, ``NUDGE_IN`` s after the start) sends ``Nudge``,
    which the participant answers for it. For keys starting ``bad`` the timer method
    raises, until ``BUG.fixed``."""

    order_id: str = ""

    def started(self, e: Watched) -> None:
        self.order_id = e.order_id
        self.set_timer("nudge", NUDGE_IN)

    @step(reply=Answered, timeout=60.0)
    def ask(self) -> Event:
        return Ask(order_id=self.order_id)

    @ask.compensate
    def undo(self) -> Event:
        return Undo(order_id=self.order_id)

    @on_timer("nudge")
    def _nudge(self) -> Event:
        if self.order_id.startswith("bad") and not BUG.fixed:
            raise RuntimeError(f"a bug in the nudge timer for {self.order_id}")
        return Nudge(order_id=self.order_id)


class Guarded(Event, type="promise.guard.started"):
    order_id: str


class UndoDeadlineSaga(Saga, name="promise.buggyundo", start=Guarded, key="order_id"):
    """A step's deadline path: ask (deadline ``BUGGY_DEADLINE``; nobody answers ``Ask``),
    then the compensation ``undo``, which raises until ``BUG.fixed``."""

    order_id: str = ""

    def started(self, e: Guarded) -> None:
        self.order_id = e.order_id

    @step(reply=Answered, timeout=BUGGY_DEADLINE)
    def ask(self) -> Event:
        return Ask(order_id=self.order_id)

    @ask.compensate
    def undo(self) -> Event:
        if not BUG.fixed:
            raise RuntimeError(f"a bug in undo for {self.order_id}")
        return Undo(order_id=self.order_id)


class Ticked(Event, type="promise.tick.started"):
    order_id: str


class Tick(Event, type="promise.tick.tick"):
    order_id: str


class Tocked(Event, type="promise.tick.tocked"):
    order_id: str


class Untick(Event, type="promise.tick.untick"):
    order_id: str


TICK_DEADLINE = 0.5
"""Seconds a :class:`TickingSaga` waits for an answer that never comes."""


class TickingSaga(Saga, name="promise.ticking", start=Ticked, key="order_id"):
    """One step nobody answers: its deadline fires and the saga is compensated."""

    order_id: str = ""

    def started(self, e: Ticked) -> None:
        self.order_id = e.order_id

    @step(reply=Tocked, timeout=TICK_DEADLINE)
    def tick(self) -> Event:
        return Tick(order_id=self.order_id)

    @tick.compensate
    def untick(self) -> Event:
        return Untick(order_id=self.order_id)


def watch_participants(ledger: Ledger, group: str) -> list[Any]:
    """Ignores ``Ask`` and ``Tick`` (recorded), answers ``Nudge`` with ``Answered``,
    records ``Undo`` and ``Untick``.

    ``Ask`` and ``Undo`` share a group: a compensation reaching a group that has not handled
    the command it undoes cancels that command instead of being handled (DESIGN 5)."""

    @subscribe(Ask.event_type, group=f"{group}.asker", concurrency=8)
    async def ask(cmd: Ask, ctx: Context) -> None:
        ledger.add("asked", cmd.order_id)

    @subscribe(Tick.event_type, group=f"{group}.ticker", concurrency=8)
    async def tick(cmd: Tick, ctx: Context) -> None:
        ledger.add("ticked", cmd.order_id)  # never answered: the deadline fires

    @subscribe(Untick.event_type, group=f"{group}.ticker", concurrency=8)
    async def untick(cmd: Untick, ctx: Context) -> None:
        ledger.add("unticked", cmd.order_id)

    @subscribe(Nudge.event_type, group=f"{group}.nudge", concurrency=8)
    async def nudge(msg: Nudge, ctx: Context) -> None:
        ledger.add("nudged", msg.order_id)
        await ctx.publish(Answered(order_id=msg.order_id))

    @subscribe(Undo.event_type, group=f"{group}.asker", concurrency=8)
    async def undo(cmd: Undo, ctx: Context) -> None:
        ledger.add("undone", cmd.order_id)

    return [ask, undo, tick, untick, nudge]


# -- one step with a deadline, its reply held by a stalled member of the saga's group -------


class Parcel(Event, type="promise.parcel.sent"):
    order_id: str


class Pick(Event, type="promise.parcel.pick"):
    order_id: str


class Picked(Event, type="promise.parcel.picked"):
    order_id: str


class Unpick(Event, type="promise.parcel.unpick"):
    order_id: str


HELD_DEADLINE = 3.0
"""Seconds :class:`ParcelSaga` waits for ``Picked``."""


class ParcelSaga(Saga, name="promise.parcel", start=Parcel, key="order_id"):
    """Pick (deadline ``HELD_DEADLINE``), compensated by ``Unpick``."""

    order_id: str = ""

    def started(self, e: Parcel) -> None:
        self.order_id = e.order_id

    @step(reply=Picked, timeout=HELD_DEADLINE)
    def pick(self) -> Event:
        return Pick(order_id=self.order_id)

    @pick.compensate
    def unpick(self) -> Event:
        return Unpick(order_id=self.order_id)


def parcel_participants(ledger: Ledger, group: str, silent: set[str]) -> list[Any]:
    """Answers ``Pick`` at once but for the ``silent`` orders (never answered)."""

    @subscribe(Pick.event_type, group=f"{group}.picking", concurrency=8)
    async def pick(cmd: Pick, ctx: Context) -> None:
        if cmd.order_id in silent:
            ledger.add("unanswered", cmd.order_id)
            return
        ledger.add("picked", cmd.order_id)
        await ctx.publish(Picked(order_id=cmd.order_id))

    @subscribe(Unpick.event_type, group=f"{group}.picking", concurrency=8)
    async def unpick(cmd: Unpick, ctx: Context) -> None:
        ledger.add("unpicked", cmd.order_id)

    return [pick, unpick]
