"""The one thread a SQLite connection is driven by.

A job goes to the thread on a ``SimpleQueue`` and its outcome comes back to the event loop
with ``call_soon_threadsafe``: one wake-up each way and nothing else. ``run_in_executor``
does the same work through a ``concurrent.futures`` future chained to an asyncio one, which
cost about twice the CPU of this per job (25 against 45-50 us on the project's machine, and
20-30 us more per job end to end) while a handling makes several trips.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any, TypeVar

__all__ = ["Worker"]

T = TypeVar("T")
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller was cancelled: nobody waits for the outcome
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class Worker:
    """A thread that runs jobs one at a time, in the order they were given."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._submitted = 0
        self._finished = 0  # written by the thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)``; the future (of the running loop) gets its outcome. The job
        runs even if the future is cancelled."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submitted += 1
        self._jobs.put((loop, future, fn, args))
        return future

    @property
    def idle(self) -> bool:
        """True when every job submitted so far has run (whether or not its outcome has
        reached the loop yet)."""
        return self._finished == self._submitted

    def stop(self) -> None:
        """Run the jobs queued so far, then end the thread; returns once it ended."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        jobs = self._jobs
        while (job := jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as exc:  # delivered to the caller, as an executor does
                outcome = (None, exc)
            self._finished += 1
            with suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, *outcome)
            del job, future, outcome  # hold no result until the next job comes
