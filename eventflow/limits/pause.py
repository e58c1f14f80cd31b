"""``Pause``: how a consumer gives back what a limit refused, and stops fetching while a
breaker its handlers met is open.

A ``GivenBack`` leaving a handler (``CircuitOpenError``, ``LimitTimeoutError``) reaches the
consumer as a failure around the handler: the dispatcher hands the lane (the refused
delivery and those of its key behind it) to ``given_back``, which releases them untouched
(no attempt spent, no redelivery counted). A ``CircuitOpenError`` also holds the gate: the
subscription's fetch loop and its workers wait until that limit's breaker lets a probe
through, so the messages wait in the broker and its lag grows. A subscription learns which
limits it uses this way, at the first refusal; one that never met an open breaker never
pauses for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .._logging import Throttled
from ..ports import Delivery
from ..runtime.stats import ConsumerStats
from .errors import CircuitOpenError, GivenBack
from .registry import Limits

__all__ = ["Pause"]

_log = logging.getLogger("eventflow.consumer")


class Pause:
    """One consumer's gate: closed while a breaker it met is open."""

    def __init__(self, limits: Limits, name: str, stats: ConsumerStats) -> None:
        self._limits = limits
        self._name = name
        self._stats = stats
        self._held: set[str] = set()
        self._log = Throttled(_log)

    @property
    def open(self) -> bool:
        """True unless a breaker this consumer met is open (fetching waits on ``wait``)."""
        return not self._held

    async def wait(self) -> None:
        """Return once every breaker holding the gate lets entries or a probe through."""
        for name in tuple(self._held):
            await self._limits.limiter(name).wait_admitting()
            if name in self._held:
                self._held.discard(name)
                self._log.clear(f"open:{name}")
                _log.info("%s: breaker of limit %s lets calls through; fetching", self._name, name)

    async def given_back(self, deliveries: Sequence[Delivery], exc: GivenBack) -> None:
        """Release ``deliveries`` untouched; after a ``CircuitOpenError``, wait with the
        gate held until the breaker lets a probe through."""
        self._stats.limited += len(deliveries)
        for delivery in deliveries:
            try:
                await delivery.release()
            except Exception as error:  # the broker redelivers it anyway
                _log.warning("%s: could not give a delivery back: %s", self._name, error)
        if isinstance(exc, CircuitOpenError):
            if exc.limit not in self._held:
                self._log.warning(
                    f"open:{exc.limit}",
                    "%s: %s; pausing this subscription's fetching",
                    self._name,
                    exc,
                )
            self._held.add(exc.limit)
            await self.wait()
        else:
            self._log.log(logging.INFO, f"wait:{exc.limit}", "%s: %s", self._name, exc)
