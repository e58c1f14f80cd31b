"""The timer loop of an app's sagas: fires each saga class's due timers.

One loop per saga class holds the store lease ``eventflow:saga-timers:<name>`` (one
instance at a time across processes) and fires the class's due timers, each in a store
transaction fenced by that lease (``Leases.fence``): a holder that lost the lease (paused
past it) commits nothing.

- **Due** is on the store's clock (:mod:`eventflow.sagas.tables`): one query reads the
  class's earliest timers with the clock's reading, so instances whose clocks disagree
  fire nothing early.
- **The reply-in-the-broker rule** (:mod:`eventflow.sagas.catch_up`): a due timer fires
  once every message of the saga's group the broker accepted before it was handled, at
  the latest ``catch_up_limit`` past it.
- **Wake-ups**: a handling that set a timer wakes its class's loop after its commit, when
  the timer is due before the loop's next look, so a near deadline fires on time; a
  handled message of the group wakes a loop whose due timer waits for the catch-up. Else
  the loop sleeps until its earliest timer, looking at least every ``POLL`` seconds (for
  timers set by other processes).
- **One firing path**: :meth:`~eventflow.sagas.handling.Handling.fire`, the code the test
  kit runs too. Saga code that raises while a timer runs it (an ``@on_timer`` method, a
  step or compensation issued after a timeout or a backoff) makes that saga ``failed``
  with the error, recorded in its history (``sagas retry`` fires that timer again); its
  other timers wait with it, and every other saga and timer goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from ..context import Context
from ..ports import Broker, Transaction
from .catch_up import MIN_RECHECK, CatchUp
from .control import Timer, TimerKind
from .definition import Saga, SagaDefinition
from .handling import Handling
from .persistence import SagaStore, TimerRow

if TYPE_CHECKING:
    from ..leases import Lease


class SagaFacade(Protocol):
    """What the timer loop uses of ``app.sagas`` (:class:`eventflow.sagas.runtime.Sagas`)."""

    @property
    def persistence(self) -> SagaStore:
        """The store's saga streams and tables."""

    @property
    def handling(self) -> Handling:
        """How inputs (here: timer firings) are applied to the store's sagas."""


__all__ = ["DEFAULT_CATCH_UP_LIMIT", "POLL", "SagaFacade", "SagaTimers", "answering", "timer_lease"]

_log = logging.getLogger("eventflow.sagas")
POLL = 0.5
"""Seconds at most between two looks at a class's timers (a safety net: wake-ups cover
timers set by this process; this covers those set by others)."""
_BATCH = 100
DEFAULT_CATCH_UP_LIMIT = 30.0


class _Wakeup:
    """When the loop of one saga class looks next, and what wakes it earlier."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.look_at = float("inf")  # monotonic; inf while it looks
        self.soonest = float("inf")  # monotonic: the earliest timer set during a look
        self.waiting_catch_up = False
        self.timer_woke = False

    def timer_set(self, delay: float) -> None:
        due = time.monotonic() + delay
        if self.look_at == float("inf"):
            # It looks now, and may or may not see this timer: the sleep after the look
            # ends by its due time (a busy saga class must not make the loop look again
            # after each look for timers due long after its next one).
            self.soonest = min(self.soonest, due)
        elif due < self.look_at:
            self.timer_woke = True
            self.event.set()

    def handled(self) -> None:
        if self.waiting_catch_up:
            self.event.set()

    async def sleep(self, seconds: float, *, catch_up: bool) -> None:
        """Until ``seconds`` passed or a wake-up. One for a handled message while a deadline
        waits for the catch-up counts ``MIN_RECHECK`` after the last look at the earliest (a
        busy group must not make the loop look once per message); a timer set counts now."""
        began = time.monotonic()
        if self.soonest < began + seconds:
            seconds = self.soonest - began
            self.timer_woke = True
        self.soonest = float("inf")
        self.waiting_catch_up = catch_up
        self.look_at = began + seconds
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(seconds, 0.001)):
                    await self.event.wait()
                    rest = MIN_RECHECK - (time.monotonic() - began)
                    if not self.timer_woke and rest > 0:
                        self.waiting_catch_up = False  # only a timer set wakes it now
                        self.event.clear()
                        async with asyncio.timeout(rest):
                            await self.event.wait()
        finally:
            self.look_at = float("inf")
            self.waiting_catch_up = False
            self.timer_woke = False
            self.event.clear()


class SagaTimers:
    """The timer loops of an app's saga classes (see the module docstring)."""

    def __init__(
        self, sagas: SagaFacade, *, catch_up_limit: float = DEFAULT_CATCH_UP_LIMIT
    ) -> None:
        self.sagas = sagas
        self.catch_up_limit = catch_up_limit
        self.broker: Broker | None = None
        self.failed = 0
        """Timer firings whose saga code raised (each left its saga ``failed``)."""
        self._started_at = 0.0
        self._wakeups: dict[str, _Wakeup] = {}
        self.catch_ups: dict[str, CatchUp] = {}
        """The catch-up state of each class whose loop runs (see ``catch_up``)."""
        self.looks: dict[str, int] = {}
        """Per saga class, the looks at its timers (store queries) since the loop began."""

    def begin(self, broker: Broker | None) -> None:
        """A run of the app starts (every start, also of an App stopped before): a deadline
        that passed before now waits for the broker's catch-up at most ``catch_up_limit``
        from now. ``broker`` (the app's) tells the saga groups' lag."""
        self._started_at = time.time()
        self.broker = broker
        self.catch_ups = {}

    def after_handling(
        self,
        ctx: Context,
        definition: SagaDefinition,
        timers: Mapping[str, tuple[float, str]],
        now: float,
    ) -> None:
        """A handling of ``definition``'s group: once its transaction commits, wake the
        class's loop if a timer it set (name: (due, token), ``due`` on the clock of ``now``)
        is due before the loop's next look, or if the loop waits for the catch-up."""
        delays = [due - now for due, _ in timers.values()]
        ctx._after_commit(functools.partial(self.committed, definition.name, delays))

    def committed(self, name: str, delays: list[float]) -> None:
        """A transition of the saga class ``name`` committed, setting timers due in
        ``delays`` seconds: wake its loop if that changes what it waits for."""
        wakeup = self._wakeups.get(name)
        if wakeup is None:
            return
        wakeup.handled()
        if delays:
            wakeup.timer_set(min(delays))

    async def run(self, cls: type[Saga]) -> None:
        """Fire the due timers of ``cls`` forever, holding its timer lease."""
        definition = cls.definition
        store = self.sagas.persistence
        await store.setup()
        if not self._started_at:  # run without begin(): this is the start
            self._started_at = time.time()
        wakeup = self._wakeups.setdefault(definition.name, _Wakeup())
        catch_up = self.catch_ups[definition.name] = CatchUp(
            self.broker,
            f"saga.{definition.name}",
            limit=self.catch_up_limit,
            started_at=self._started_at,
        )
        async with store.store.leases.hold(timer_lease(definition)) as lease:
            while True:
                rows, now = await store.earliest(definition.name, _BATCH)
                self.looks[definition.name] = self.looks.get(definition.name, 0) + 1
                wait, fired, held = POLL, False, False
                for row in rows:
                    if row.due > now:
                        wait = min(wait, row.due - now)
                        break
                    pause = None
                    if catch_up.may_hold(row.due, now):
                        topics = await self._answering(definition, row)
                        pause = await catch_up.wait_for(row.due, now, topics)
                    if pause is not None:
                        held = True
                        wait = min(wait, pause)
                        continue
                    await self._fire(cls, row, lease)
                    fired = True
                if fired:
                    continue  # look again: more due, or what the firings set
                await wakeup.sleep(wait, catch_up=held)

    async def _answering(self, definition: SagaDefinition, row: TimerRow) -> list[str]:
        """The topics that can answer the timer ``row``, from the typed timer its saga set
        there (one read of the saga's stream; none when the catch-up is already decided)."""
        loaded = await self.sagas.persistence.load(definition, row.key)
        timer = loaded.control.timer_at(row.timer) if loaded is not None else None
        return answering(definition, timer)

    async def _fire(self, cls: type[Saga], row: TimerRow, lease: Lease) -> None:
        """Fire ``row`` through :meth:`Handling.fire` (the code the test kit runs too),
        fenced by the timer lease."""
        leases = self.sagas.persistence.store.leases

        async def fence(tx: Transaction) -> None:
            # Last, just before the commit (Handling.fire places it so): on PostgreSQL the
            # fence holds the lease's row until the transaction ends, and a takeover waits
            # for it (a holder paused inside the transaction would hold it off meanwhile).
            await leases.fence(lease, tx)

        handling = self.sagas.handling
        failed = handling.failed_timers
        await handling.fire(cls, row, fence=fence)
        self.failed += handling.failed_timers - failed


def answering(definition: SagaDefinition, timer: Timer | None) -> list[str]:
    """The topics whose messages can answer ``timer`` before it fires: for a step's deadline
    or backoff, the step's reply and reject and its compensation's reply; for a named timer
    (or a step a deploy removed, or a timer no longer set), every topic of the saga but its
    start's."""
    if timer is not None and timer.kind is not TimerKind.NAMED:
        with contextlib.suppress(KeyError):
            s = definition.step(timer.name)
            undo = s.compensation.reply if s.compensation is not None else ()
            return [t.event_type for t in (*s.reply, *s.reject, *undo)]
    start = definition.start.event_type
    return [t.event_type for t in definition.input_types() if t.event_type != start]


def timer_lease(definition: SagaDefinition) -> str:
    """The lease the timer loop of a saga class holds (its firings are fenced by it)."""
    return f"eventflow:saga-timers:{definition.name}"
