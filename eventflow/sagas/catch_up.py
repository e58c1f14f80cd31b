"""The reply-in-the-broker rule of saga deadlines (DESIGN 5): one mechanism, whatever the
app was doing at the deadline (running with consumer lag, a member of the saga's group
stalled or killed while holding a reply, the saga's process down).

A deadline fires only once every message of the saga's group that the broker accepted
before it has been handled, and at the latest ``catch_up_limit`` seconds past it (past the
start of this run of the app, for a deadline that passed while no instance ran: the wait
for the broker is bounded from when it can begin). The broker tells it with
:meth:`~eventflow.ports.Broker.lag` on each of the group's patterns (one per event type the
saga takes): nothing pending at the ask (``messages == 0``), or the oldest message pending
published after the deadline. What an ask shows stays true (a message handled stays
handled), so :class:`CatchUp` keeps, per saga class, the time up to which the group is
known to have handled everything, and asks again only for a later deadline.

A lag call that fails (the broker is down or slow) decides nothing: the deadline waits and
the broker is asked again after ``RECHECK`` seconds. While a deadline waits, the timer loop
asks again when a message of the group was handled (at most every ``MIN_RECHECK``
seconds), every ``RECHECK`` seconds (a member that holds a message and does not answer
gives it back only when it leaves), and at the limit.

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
        self,
        broker: Broker | None,
        group: str,
        patterns: Sequence[str],
        *,
        limit: float,
        started_at: float,
    ) -> None:
        self.broker = broker
        self.group = group
        self.patterns = tuple(patterns)
        self.limit = limit
        self.started_at = started_at
        self.clear_until = float("-inf")
        """Everything the broker accepted before this time was handled (Unix seconds)."""
        self.asks = 0
        """Lag asks made (each asks every pattern)."""
        self.failed = 0
        """Asks that failed (the broker could not tell)."""
        self._asked_at = float("-inf")  # monotonic

    async def wait_for(self, due: float, now: float) -> float | None:
        """None when the deadline ``due`` may fire at ``now`` (both on the store's clock);
        else the seconds after which asking again is worth it."""
        limit_at = max(due, self.started_at) + self.limit
        if now >= limit_at or self.broker is None or due <= self.clear_until:
            return None
        left = limit_at - now
        since = time.monotonic() - self._asked_at
        if since < MIN_RECHECK:
            return min(MIN_RECHECK - since, left)
        if not await self._ask():
            return min(RECHECK, left)
        if due <= self.clear_until:
            return None
        return min(RECHECK, left)

    async def _ask(self) -> bool:
        """Ask the broker the group's lag on every pattern; False if it could not tell."""
        assert self.broker is not None
        lag = declared(self.broker, Broker, "lag")
        self._asked_at = time.monotonic()
        asked_at = time.time()
        self.asks += 1
        try:
            lags: list[Lag] = await asyncio.gather(
                *(lag(pattern, group=self.group) for pattern in self.patterns)
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
        clear = asked_at
        for one in lags:
            if one.messages and one.oldest is not None:
                clear = min(clear, one.oldest.timestamp())
        self.clear_until = max(self.clear_until, clear)
        return True
