"""Handler timeouts: one timer per consumer that cancels handler calls running too long.

A worker marks each handler call on its ``Watch`` (two counter increments, no clock read);
the watchdog ticks, times each call from the first tick that sees it, and cancels the
worker task of one that runs past the timeout. The worker then tells its own timeout from
a shutdown's cancellation (``Watch.timed_out``) and takes the watchdog's request back.

Python 3.11: a handler's task group whose child failed after the group's body ended leaves
a cancel request counted on the task for good, so "ours" is one more request than the
task had when the watchdog cancelled it (``cancels_before``), not "at most one".
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

__all__ = ["HardTimeouts", "Watch", "Watchdog"]


class HardTimeouts(Protocol):
    """What times the watchdogs' calls against their ``hard_timeout`` from outside the loop
    (the app's ``stall.StallGuard``)."""

    def add(self, watchdog: Watchdog) -> None:
        """Time ``watchdog``'s calls from now on."""

    def remove(self, watchdog: Watchdog) -> None:
        """Stop timing ``watchdog``'s calls."""


class Watch:
    """What the watchdog knows of one worker task: the handler call it is in, if any.

    ``calls`` goes up by one as a handler call starts and by one as it ends (odd: in a
    handler), so a worker marks its calls with two increments and no clock read; the
    watchdog times a call from the tick that first sees it.
    """

    __slots__ = (
        "calls",
        "cancels_before",
        "expired",
        "hard_seen",
        "hard_seen_at",
        "seen",
        "seen_at",
        "task",
    )

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.calls = 0
        self.expired = False  # the watchdog cancelled the current call
        # The task's cancel requests when the watchdog cancelled it: a handler's task group
        # may have left one counted for good (Python 3.11), so "ours" is one more than that.
        self.cancels_before = 0
        self.seen = 0  # the call the watchdog is timing (0: none)
        self.seen_at = 0.0
        self.hard_seen = 0  # the call the stall guard's thread is timing (hard_timeout)
        self.hard_seen_at = 0.0

    def enter(self) -> None:
        """A handler call starts."""
        self.calls += 1

    def timed_out(self) -> bool:
        """Inside the handler call's ``except CancelledError``: True if the cancellation is
        the watchdog's alone. A shutdown's request arriving at the same time leaves one more,
        and must still stop the worker."""
        return self.expired and self.task.cancelling() <= self.cancels_before + 1

    def leave(self) -> None:
        """The handler call ended (any way): take back the watchdog's request if it fired."""
        self.calls += 1
        if self.expired:
            self.expired = False
            self.task.uncancel()

    def expire(self) -> None:
        """Cancel the worker's current handler call (the watchdog's request)."""
        self.expired = True
        self.cancels_before = self.task.cancelling()
        self.task.cancel()


class Watchdog:
    """Cancels handler calls that run past ``timeout``: one timer per consumer, not per
    message.

    Checked every ``timeout / 20`` (5 ms to 1 s). A call is timed from the first tick that
    sees it, so it is never cancelled early, and while ticks come on time (nothing blocks
    the loop) at most two ticks late: a tenth of a timeout of 0.1 s or more.

    With ``hard_timeout`` and a ``guard``, the guard's thread times the same calls against
    the hard timeout while ``run`` runs (a loop that is blocked runs no tick of this one).
    """

    def __init__(
        self,
        timeout: float,
        *,
        hard_timeout: float | None = None,
        guard: HardTimeouts | None = None,
        name: str = "",
    ) -> None:
        self.timeout = timeout
        self.hard_timeout = hard_timeout
        self.name = name
        self._guard = guard if hard_timeout is not None else None
        self._watches: list[Watch] = []

    def watches(self) -> list[Watch]:
        """The watches of this watchdog's workers (a copy: safe to read from a thread)."""
        return list(self._watches)

    def watch(self) -> Watch:
        """A watch over the current task (a worker), timed by this watchdog."""
        watch = unwatched()
        self._watches.append(watch)
        return watch

    async def run(self) -> None:
        """Tick until cancelled (and meanwhile have the guard time the hard timeout)."""
        guard = self._guard
        if guard is not None:
            guard.add(self)
        try:
            await self._tick()
        finally:
            if guard is not None:
                guard.remove(self)

    async def _tick(self) -> None:
        timeout = self.timeout
        tick = min(max(timeout / 20, 0.005), 1.0)
        clock = asyncio.get_running_loop().time  # a loop may keep its own time
        while True:
            await asyncio.sleep(tick)
            now = clock()
            for watch in self._watches:
                calls = watch.calls
                if not calls & 1:
                    continue  # not in a handler
                if calls != watch.seen:
                    watch.seen, watch.seen_at = calls, now
                elif now - watch.seen_at >= timeout and not watch.expired:
                    watch.expire()


def unwatched() -> Watch:
    """A watch over the current task that no watchdog times (a handler without timeout)."""
    task = asyncio.current_task()
    assert task is not None, "a watch belongs to a task"
    return Watch(task)
