"""The stall guard: a thread that watches an app's event loop from outside it.

Two jobs, both of which the loop cannot do for itself while it is blocked:

- **A blocked loop.** Every ``loop_block_warning / 4`` seconds the thread asks the loop to
  answer a ping (``call_soon_threadsafe``); when the loop has not answered one for
  ``loop_block_warning`` seconds it logs a WARNING with the stack of the loop's thread (the
  code that blocks it), once per block, and an INFO line when the loop answers again.
- **Hard timeouts.** A consumer whose handler has ``hard_timeout`` hands its watchdog to
  the guard (``Watchdog.run`` registers it while it runs). The thread times each handler
  call from the first look that sees it, as the soft watchdog does, by the watch's call
  counter (no clock read on the worker's side). A call still running ``hard_timeout`` after
  that logs, at CRITICAL, the stacks that hold it (the loop's thread and the handler's
  coroutine) and ends the process with :data:`HARD_TIMEOUT_EXIT_CODE`: at once
  (``os._exit``), since a loop that is blocked can run no shutdown. The message was not
  acked, so the broker redelivers it to another member; the restarted process counts the
  start towards ``max_deliveries`` (a message that hangs every process ends as a crash
  loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from .watchdog import Watch, Watchdog

__all__ = [
    "DEFAULT_LOOP_BLOCK_WARNING",
    "HARD_TIMEOUT_EXIT_CODE",
    "StallGuard",
    "check_loop_block_warning",
]

DEFAULT_LOOP_BLOCK_WARNING = 1.0
"""Seconds the event loop may leave a ping unanswered before its stack is logged."""
HARD_TIMEOUT_EXIT_CODE = 70
"""The exit status of a process ended by a hard timeout (``EX_SOFTWARE``)."""
_TICK_MIN, _TICK_MAX = 0.05, 1.0
_JOIN_TIMEOUT = 2.0
_log = logging.getLogger("eventflow.watchdog")


def check_loop_block_warning(value: object) -> float | None:
    """``App(loop_block_warning=...)``: seconds above 0, or None for no watch."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
        raise ConfigurationError(
            f"loop_block_warning must be a number of seconds above 0 (or None to turn the "
            f"blocked-loop watch off), got {value!r}"
        )
    return float(value)


class StallGuard:
    """The watchdog thread of one running app (see the module docstring).

    ``exit`` ends the process (``os._exit`` by default); tests of the thread pass another.
    Started and stopped by the app; ``start`` and ``stop`` are idempotent.
    """

    def __init__(
        self,
        loop_block_warning: float | None,
        *,
        name: str = "app",
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.loop_block_warning = loop_block_warning
        self._name = name
        self._exit = exit
        self._watchdogs: list[Watchdog] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._answered = True  # the last ping was answered
        self._sent_at = 0.0
        self._warned_at = 0.0  # 0.0: no warning out for the current ping
        self.blocks = 0
        """How many times the loop was reported blocked."""

    # -- the loop's side ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread, watching the running loop (call it from the loop's thread)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stop.clear()
        self._answered = True
        thread = threading.Thread(target=self._run, name=f"eventflow-watchdog {self._name}")
        thread.daemon = True  # a process that ends never waits for it
        self._thread = thread
        thread.start()

    def stop(self) -> None:
        """Stop the thread (waits a moment for it)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(_JOIN_TIMEOUT)

    def add(self, watchdog: Watchdog) -> None:
        """Time the handler calls of ``watchdog``'s watches against its ``hard_timeout``."""
        self._watchdogs = [*self._watchdogs, watchdog]  # a new list: the thread reads it

    def remove(self, watchdog: Watchdog) -> None:
        """Stop timing ``watchdog``'s calls (its dispatcher's run ended)."""
        self._watchdogs = [w for w in self._watchdogs if w is not watchdog]

    def _pong(self) -> None:
        """The loop answers a ping."""
        warned_at = self._warned_at
        self._answered = True
        if warned_at:
            self._warned_at = 0.0
            _log.info(
                "%s: the event loop answers again, blocked for %.1fs in all",
                self._name,
                time.monotonic() - self._sent_at,
            )

    # -- the thread --------------------------------------------------------------------------

    def _tick(self) -> float:
        ticks = [t.hard_timeout / 20 for t in self._watchdogs if t.hard_timeout is not None]
        if self.loop_block_warning is not None:
            ticks.append(self.loop_block_warning / 4)
        return min(max(min(ticks, default=_TICK_MAX), _TICK_MIN), _TICK_MAX)

    def _run(self) -> None:
        while not self._stop.wait(self._tick()):
            now = time.monotonic()
            try:
                if self.loop_block_warning is not None:
                    self._ping(now)
                for watchdog in self._watchdogs:
                    self._check_hard(watchdog, now)
            except Exception:  # the guard must not die of a bug while the app runs on
                _log.exception("%s: the watchdog thread failed a check", self._name)

    def _ping(self, now: float) -> None:
        limit = self.loop_block_warning
        assert limit is not None and self._loop is not None
        if self._answered:
            self._answered = False
            self._sent_at = now
            try:
                self._loop.call_soon_threadsafe(self._pong)
            except RuntimeError:  # the loop is closed: nothing left to watch
                self._stop.set()
            return
        if not self._warned_at and now - self._sent_at >= limit:
            self._warned_at = now
            self.blocks += 1
            _log.warning(
                "%s: the event loop has not answered for %.1fs (loop_block_warning=%gs): "
                "something blocks it, every handler of the process waits meanwhile. The "
                "stack of the loop's thread (move blocking calls to a thread with "
                "`await asyncio.to_thread(...)`):\n%s",
                self._name,
                now - self._sent_at,
                limit,
                self._loop_stack(),
            )

    def _check_hard(self, watchdog: Watchdog, now: float) -> None:
        limit = watchdog.hard_timeout
        if limit is None:
            return
        for watch in watchdog.watches():
            calls = watch.calls
            if not calls & 1:
                continue  # not in a handler
            if calls != watch.hard_seen:
                watch.hard_seen, watch.hard_seen_at = calls, now
            elif now - watch.hard_seen_at >= limit:
                self._hard_timeout(watchdog, watch, now - watch.hard_seen_at)
                return

    def _hard_timeout(self, watchdog: Watchdog, watch: Watch, running: float) -> None:
        _log.critical(
            "%s: handler %s is still running %.1fs after it started (timeout=%gs, "
            "hard_timeout=%gs): it ignored the cancellation or blocks the event loop. Ending "
            "the process with exit status %d so that its supervisor restarts it and the "
            "broker redelivers the message to another member.\n"
            "The stack of the event loop's thread:\n%s\nThe handler's coroutine:\n%s",
            self._name,
            watchdog.name,
            running,
            watchdog.timeout,
            watchdog.hard_timeout,
            HARD_TIMEOUT_EXIT_CODE,
            self._loop_stack(),
            _coroutine_stack(watch.task),
        )
        for handler in logging.getLogger().handlers + _log.handlers:
            with contextlib.suppress(Exception):  # exiting anyway
                handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        self._stop.set()
        self._exit(HARD_TIMEOUT_EXIT_CODE)

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "  (the loop's thread has ended)\n"
        return "".join(traceback.format_stack(frame))


def _coroutine_stack(task: asyncio.Task[Any]) -> str:
    """The frames of ``task``'s coroutine chain, outermost first (read from another thread:
    a best effort, for the log)."""
    lines: list[str] = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame: FrameType | None = getattr(awaited, "cr_frame", None) or getattr(
            awaited, "gi_frame", None
        )
        if frame is None:
            break
        lines.extend(traceback.format_stack(frame, limit=1))
        if getattr(awaited, "cr_running", False):
            lines.append("  (running now: the rest is on the loop thread's stack above)\n")
            break
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return "".join(lines) or "  (not in a coroutine frame)\n"
