"""The timer loop of an app's sagas: fires each saga class's due timers.

One loop per saga class, holding the store lease ``eventflow:saga-timers:<name>`` (one
instance at a time across processes), fires due timers, each in a store transaction
fenced by that lease. A timer that came due while no instance ran waits, when the app
starts, until the broker has nothing left for the saga's group (``Broker.backlog`` is 0 on
each of its patterns: nothing undelivered, nothing delivered and not acked, also what a
killed member still holds), at most ``catch_up_limit`` seconds: a reply that reached the
broker before the deadline wins over the timeout. A broker that cannot tell its backlog
(None) leaves the older rule: each saga consumer had a fetch that found nothing left.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from .._logging import Throttled
from ..envelope import hashed_id
from ..errors import BrokerError
from .definition import Saga, SagaDefinition
from .machine import Machine
from .persistence import Loaded, TimerRow, build_saga

if TYPE_CHECKING:
    from ..leases import Lease
    from .runtime import Sagas

__all__ = ["DEFAULT_CATCH_UP_LIMIT", "CaughtUp", "SagaTimers"]

_log = logging.getLogger("eventflow.sagas")
_warn = Throttled(_log)
_TIMER_POLL = 0.5
_BACKLOG_CACHE = 0.2
DEFAULT_CATCH_UP_LIMIT = 30.0


class CaughtUp(Protocol):
    """What the timer loop asks of a consumer (``runtime.consumer.Consumer``)."""

    @property
    def group(self) -> str:
        """The consumer group."""

    @property
    def caught_up_at(self) -> float:
        """When a fetch last found nothing left (wall time; 0.0: not yet)."""

    async def backlog(self) -> int | None:
        """What the group still has to handle on the consumer's pattern (None: unknown)."""


class SagaTimers:
    """The timer loops of an app's saga classes (see the module docstring)."""

    def __init__(self, sagas: Sagas, *, catch_up_limit: float = DEFAULT_CATCH_UP_LIMIT) -> None:
        self.sagas = sagas
        self.catch_up_limit = catch_up_limit
        self._started_at = 0.0
        self._wake = asyncio.Event()
        self._caught_up: dict[str, builtins.list[CaughtUp]] = {}
        self._backlogs: dict[str, tuple[float, int | None]] = {}  # group -> (at, sum)

    def begin(self, consumers: Iterable[CaughtUp]) -> None:
        """A run of the app starts (every start, also of an App stopped before): timers due
        before now wait for this run's saga consumers to catch up, not the last run's."""
        self._started_at = time.time()
        self._caught_up = {}
        for consumer in consumers:
            self.watch_consumer(consumer)

    def watch_consumer(self, consumer: CaughtUp) -> None:
        """Let the timer loop ask a consumer of the app when it last had nothing left (only
        the saga groups' consumers count)."""
        if consumer.group.startswith("saga."):
            self._caught_up.setdefault(consumer.group, []).append(consumer)

    def timers_set(
        self, definition: SagaDefinition, timers: Mapping[str, tuple[float, str]]
    ) -> None:
        """A handling of ``definition``'s saga set ``timers`` (name: (due, token))."""
        # The timer loop looks at least every _TIMER_POLL seconds: wake it only for a timer
        # due before its next look (waking it for every step's timeout cost two queries).
        if timers and min(due for due, _ in timers.values()) < time.time() + _TIMER_POLL:
            self._wake.set()

    async def run(self, cls: type[Saga]) -> None:
        """Fire the due timers of ``cls`` forever, holding its timer lease."""
        definition = cls.definition
        store = self.sagas.persistence
        await store.setup()
        if not self._started_at:  # run without begin(): this is the start
            self._started_at = time.time()
        async with store.store.leases.hold(_timer_lease(definition)) as lease:
            while True:
                self._wake.clear()
                rows, now = await store.earliest(definition.name)
                for row in rows:
                    if row.due > now:
                        break
                    if not await self._may_fire(definition, row, now):
                        continue
                    await self._fire(cls, row, lease)
                rows, now = await store.earliest(definition.name, 1)
                wait = _TIMER_POLL if not rows else min(_TIMER_POLL, max(0.0, rows[0].due - now))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=max(wait, 0.005))

    async def _may_fire(self, definition: SagaDefinition, row: TimerRow, now: float) -> bool:
        """A timer due before this app started fires once the broker has nothing left for
        the saga's group (or ``catch_up_limit`` after the start); with a broker that cannot
        tell, once each saga consumer had a fetch that found nothing left."""
        if row.due >= self._started_at or now >= self._started_at + self.catch_up_limit:
            return True
        group = f"saga.{definition.name}"
        watched = self._caught_up.get(group, [])
        backlog = await self._backlog(group, watched, now)
        if backlog is not None:
            return backlog == 0
        return all(c.caught_up_at >= self._started_at for c in watched)

    async def _backlog(self, group: str, watched: Sequence[CaughtUp], now: float) -> int | None:
        """The group's backlog over its consumers' patterns, asked at most every
        ``_BACKLOG_CACHE`` seconds; None if the broker cannot tell (or cannot be asked)."""
        cached = self._backlogs.get(group)
        if (
            cached is not None
            and self._started_at <= cached[0]
            and now - cached[0] < _BACKLOG_CACHE
        ):
            return cached[1]
        total: int | None
        try:
            values = await asyncio.gather(*(c.backlog() for c in watched))
        except BrokerError as exc:
            _warn.warning(
                f"backlog {group}",
                "saga group %s: the broker did not tell its backlog (%s); overdue timers "
                "wait for an empty fetch instead",
                group,
                exc,
            )
            total = None
        else:
            total = None if None in values else sum(v for v in values if v is not None)
        self._backlogs[group] = (now, total)
        return total

    async def _fire(self, cls: type[Saga], row: TimerRow, lease: Lease) -> None:
        definition = cls.definition
        sagas = self.sagas
        store = sagas.persistence.store
        message_id = hashed_id(0, "saga-timer", row.saga_id, row.timer, row.token)

        async def run(loaded: Loaded | None, now: float) -> Machine | None:
            if loaded is None:
                return None
            machine = Machine(build_saga(cls, loaded), loaded.control, now)
            await machine.timer(row.timer, row.token, message_id)
            return machine

        async with store.transaction() as tx:
            machine = await sagas.apply(tx, cls, row.key, run, cause=None)
            if machine is None or not machine.out.changed:
                # No saga, or a timer cancelled or rescheduled: its row goes.
                await sagas.persistence.drop_timer(tx, row)
            if machine is None:
                return
            await store.outbox.add(
                sagas.commands(definition, machine.control, machine.out, None), tx=tx
            )
            # Fenced: a holder that lost the lease (paused past it) commits nothing.
            await store.checkpoints.set(
                _timer_lease(definition), int(machine.now * 1000), tx=tx, lease=lease
            )


def _timer_lease(definition: SagaDefinition) -> str:
    """The lease the timer loop of a saga holds, and the checkpoint its firings are fenced by."""
    return f"eventflow:saga-timers:{definition.name}"
