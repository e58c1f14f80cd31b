"""The reply-in-the-broker rule of saga deadlines (DESIGN 5): one mechanism, whatever the
app was doing at the deadline (running with consumer lag, a member of the saga's group
stalled or killed while holding a reply, the saga's process down).

A deadline fires only once every message of the saga's group that the broker accepted
before it, on the topics that can answer it, has been handled, and at the latest
``catch_up_limit`` seconds past it (past the start of this run of the app, for a deadline
that passed while no instance ran: the wait for the broker is bounded from when it can
begin). The topics that can answer a step's deadline (or its backoff) are the step's reply
and reject topics and its compensation's reply topic; those of a named timer, every topic
of the saga but its start's (:func:`eventflow.sagas.timers.answering`). The broker tells
it with :meth:`~eventflow.ports.Broker.lag` on each: nothing pending at the ask
(``messages == 0``), or the oldest message pending published after the deadline. What an
ask shows stays true (a message handled stays handled), so :class:`CatchUp` keeps, per
topic of a saga class, the time up to which the group is known to have handled
everything, and asks again only for a later deadline.

A lag call that fails (the broker is down or slow) decides nothing: the deadline waits and
the broker is asked again after ``RECHECK`` seconds. A deadline later than what the last
ask cleared asks again at once, unless that ask found messages pending on its topics: then
the timer loop asks again when a message of the group was handled (at most every
``MIN_RECHECK`` seconds), every ``RECHECK`` seconds (a member that holds a message and
does not answer gives it back only when it leaves), and at the limit.

Clocks: the deadline is on the store's clock, ``oldest`` on the broker's and the moment of
an ask on this host's; instances are expected to agree within a small fraction of a step's
timeout (what NTP keeps).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from .._logging import Throttled
from ..ports import Broker, Lag, declared

__all__ = ["MIN_RECHECK", "RECHECK", "CatchUp"]

_log = logging.getLogger("eventflow.sagas")
_warn = Throttled(_log)

RECHECK = 1.0
"""Seconds between asks while a deadline waits and nothing of the group is handled."""
MIN_RECHECK = 0.1
"""Seconds at least between two asks for one saga class (messages handled meanwhile)."""


class CatchUp:
    """Whether a deadline of one saga class may fire (see the module docstring).

    ``broker`` None: the timers run without a broker (a test kit's virtual clock), where no
    message can wait: every due deadline fires."""

    def __init__(
        self, broker: Broker | None, group: str, *, limit: float, started_at: float
    ) -> None:
        self.broker = broker
        self.group = group
        self.limit = limit
        self.started_at = started_at
        self.clear_until: dict[str, float] = {}
        """Per pattern: everything the broker accepted before this time was handled."""
        self.asks = 0
        """Lag asks made (each asks the patterns a deadline waits for)."""
        self.failed = 0
        """Asks that failed (the broker could not tell)."""
        self._asked_at = float("-inf")  # monotonic
        self._held: set[str] = set()  # patterns whose last ask found messages pending

    def _waits_for(self, due: float, patterns: Sequence[str]) -> list[str]:
        never = float("-inf")
        return [p for p in patterns if self.clear_until.get(p, never) < due]

    def may_hold(self, due: float, now: float) -> bool:
        """Whether the deadline ``due`` can still wait at ``now``: False past the limit, or
        without a broker (then it fires; no need to find the topics that answer it)."""
        return self.broker is not None and now < max(due, self.started_at) + self.limit

    async def wait_for(self, due: float, now: float, patterns: Sequence[str]) -> float | None:
        """None when the deadline ``due`` may fire at ``now`` (both on the store's clock),
        answered on ``patterns``; else the seconds after which asking again is worth it."""
        limit_at = max(due, self.started_at) + self.limit
        if not self.may_hold(due, now):
            return None
        pending = self._waits_for(due, patterns)
        if not pending:
            return None
        left = limit_at - now
        since = time.monotonic() - self._asked_at
        if since < MIN_RECHECK and self._held.intersection(pending):
            # The last ask found messages pending there: give them time to be handled.
            return min(MIN_RECHECK - since, left)
        if not await self._ask(pending):
            return min(RECHECK, left)
        if not self._waits_for(due, pending):
            return None
        return min(RECHECK, left)

    async def _ask(self, patterns: Sequence[str]) -> bool:
        """Ask the broker the group's lag on ``patterns``; False if it could not tell."""
        assert self.broker is not None
        lag = declared(self.broker, Broker, "lag")
        self._asked_at = time.monotonic()
        asked_at = time.time()
        self.asks += 1
        try:
            lags: list[Lag] = await asyncio.gather(
                *(lag(pattern, group=self.group) for pattern in patterns)
            )
        except Exception as exc:  # BrokerError, or an adapter's bug: it decides nothing
            self.failed += 1
            _warn.warning(
                f"lag {self.group}",
                "saga group %s: the broker could not tell its lag (%s: %s); due deadlines "
                "wait and ask again in %gs (at most until catch_up_limit past them)",
                self.group,
                type(exc).__name__,
                exc,
                RECHECK,
            )
            return False
        _warn.clear(f"lag {self.group}")
        for pattern, one in zip(patterns, lags, strict=True):
            clear = asked_at
            self._held.discard(pattern)
            if one.messages and one.oldest is not None:
                clear = min(clear, one.oldest.timestamp())
                self._held.add(pattern)
            self.clear_until[pattern] = max(self.clear_until.get(pattern, clear), clear)
        return True
