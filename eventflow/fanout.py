"""``ctx.gather(calls, limit=10)``: bounded fan-out from a handler that keeps every item's
outcome, a value or the exception, instead of losing the rest at the first failure.

``gather`` runs at most ``limit`` of the calls at once (a pool of ``limit`` workers taking
the calls in order), waits for all of them, and returns a :class:`Gathered`: one
:class:`GatherResult` per call, in the order of the calls. Cancelling the caller (the
handler's soft timeout, a shutdown) cancels every call still running and closes the ones
not begun.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from .errors import ConfigurationError
from .limits.errors import GivenBack

__all__ = ["Call", "GatherResult", "Gathered", "gather"]

T = TypeVar("T")

Call = Awaitable[T] | Callable[[], Awaitable[T]]
"""One item of ``gather``: an awaitable (a coroutine object) or a function of no arguments
that returns one (``functools.partial(charge, order)``, a lambda)."""


@dataclass(frozen=True, slots=True)
class GatherResult(Generic[T]):
    """The outcome of one call: its ``value``, or the ``error`` it raised."""

    value: T | None = None
    """What the call returned (None when it failed)."""
    error: Exception | None = None
    """The exception the call raised, or None when it succeeded."""

    @property
    def ok(self) -> bool:
        """Whether the call returned without raising."""
        return self.error is None

    def unwrap(self) -> T:
        """The value, or raise the call's exception."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]  # a call may return None itself


class Gathered(Sequence[GatherResult[T]]):
    """The outcomes of ``ctx.gather``: a sequence of :class:`GatherResult`, one per call, in
    the order of the calls, whatever order they finished in."""

    __slots__ = ("_results",)

    def __init__(self, results: list[GatherResult[T]]) -> None:
        self._results = results

    @overload
    def __getitem__(self, index: int) -> GatherResult[T]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[GatherResult[T]]: ...

    def __getitem__(self, index: int | slice) -> GatherResult[T] | Sequence[GatherResult[T]]:
        """The outcome of the call at ``index`` (or a list of them for a slice)."""
        return self._results[index]

    def __len__(self) -> int:
        """How many calls were gathered."""
        return len(self._results)

    def __iter__(self) -> Iterator[GatherResult[T]]:
        """The outcomes in the order of the calls."""
        return iter(self._results)

    def __repr__(self) -> str:
        """``Gathered(3 ok, 1 failed)``."""
        return f"Gathered({len(self.values)} ok, {len(self.errors)} failed)"

    @property
    def ok(self) -> bool:
        """Whether every call succeeded."""
        return all(r.error is None for r in self._results)

    @property
    def values(self) -> list[T]:
        """The values of the calls that succeeded, in order."""
        return [r.value for r in self._results if r.error is None]  # type: ignore[misc]

    @property
    def errors(self) -> list[Exception]:
        """The exceptions of the calls that failed, in order."""
        return [r.error for r in self._results if r.error is not None]

    def raise_if_failed(self) -> list[T]:
        """Return every call's value in order if all succeeded; otherwise raise one of the
        failures so that the handler's attempt ends as that error says.

        The error raised is the first one that gives the message back (``CircuitOpenError``,
        ``LimitTimeoutError``: the dependency is down or busy, so no attempt is spent), else
        the first failure in the order of the calls (a ``Reject`` dead-letters the message,
        anything else is retried). The other failures are listed in its notes. On a retry
        every call runs again: make them idempotent (``ctx.idempotency_key`` plus the item),
        or handle the failures one by one instead of raising."""
        failed = [(i, r.error) for i, r in enumerate(self._results) if r.error is not None]
        if not failed:
            return [r.value for r in self._results]  # type: ignore[misc]
        given_back = [f for f in failed if isinstance(f[1], GivenBack)]
        index, error = (given_back or failed)[0]
        for i, other in failed:
            if other is not error:
                error.add_note(f"ctx.gather: call {i} also failed: {type(other).__name__}: {other}")
        error.add_note(f"ctx.gather: raised for call {index}, {len(failed)} of {len(self)} failed")
        raise error


async def gather(
    calls: Iterable[Call[T]],
    limit: int = 10,
    *,
    take: Callable[[], AbstractAsyncContextManager[None]] | None = None,
) -> Gathered[T]:
    """Run ``calls`` with at most ``limit`` of them at once; return each one's outcome.

    ``take``, when given, is entered around each call (what ``ctx.gather(...,
    limit_name=...)`` passes: a declared ``ctx.limit``). An exception a call raises is kept
    as its outcome; the other calls go on. A ``BaseException`` that is not an ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``) and the caller's cancellation end them all: the
    running calls are cancelled, the calls not begun are closed, and it propagates.

    An awaitable that is already running (an ``asyncio.Task``) is not bounded by ``limit``;
    pass coroutines or functions for the bound to hold."""
    items = list(calls)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        _close_all(items)
        raise ConfigurationError(
            f"ctx.gather(..., limit=...) takes a whole number of calls >= 1, got {limit!r}"
        )
    if take is not None:
        try:
            take()  # a limit's entry does nothing until entered: this checks its name
        except BaseException:
            _close_all(items)
            raise
    for i, item in enumerate(items):
        if not (inspect.isawaitable(item) or callable(item)):
            _close_all(items)
            raise TypeError(
                f"ctx.gather: call {i} is {type(item).__name__}, neither an awaitable nor a "
                "function of no arguments; pass coroutines (charge(order)) or functions "
                "(functools.partial(charge, order))"
            )
    results: list[GatherResult[T] | None] = [None] * len(items)
    begun = [False] * len(items)
    queue = iter(range(len(items)))

    async def run(item: Call[T]) -> T:
        if take is None:
            return await _awaitable(item)
        entered = False
        try:
            async with take():
                entered = True
                # A function is called only here, inside the limit: one the limit refuses
                # leaves no coroutine unawaited.
                return await _awaitable(item)
        finally:
            if not entered:
                _close_all([item])  # refused by the limit: a coroutine given never runs

    async def worker() -> None:
        for i in queue:
            begun[i] = True
            try:
                value = await run(items[i])
            except Exception as exc:  # kept as the call's outcome; the others go on
                results[i] = GatherResult(error=exc)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the caller is cancelled: end them all
                # The call cancelled itself (or a task it awaited was cancelled): a failure
                # of this call, not of the caller.
                error = RuntimeError(f"ctx.gather: call {i} was cancelled by its own code")
                error.__cause__ = exc
                results[i] = GatherResult(error=error)
            else:
                results[i] = GatherResult(value=value)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(limit, len(items))):
                group.create_task(worker())
    except BaseException:
        _close_all(item for i, item in enumerate(items) if not begun[i])
        raise
    return Gathered([r if r is not None else GatherResult() for r in results])


def _awaitable(item: Call[T]) -> Awaitable[T]:
    """The awaitable of one call: the item itself, or what the function returns."""
    return item() if callable(item) and not inspect.isawaitable(item) else item


def _close_all(items: Iterable[object]) -> None:
    """Close coroutines never awaited and cancel futures never waited for, so that nothing
    warns "coroutine ... was never awaited" or goes on running unowned."""
    for item in items:
        if inspect.iscoroutine(item):
            item.close()
        elif isinstance(item, asyncio.Future):
            item.cancel()
