"""Supervision: background components that restart after transient failures and fail their
owner visibly when they cannot recover.

An app owns one :class:`Supervisor`; its consumers, relays, projection runners and
heartbeat, and the background loops of its adapters (the PostgreSQL sequencer, the Kafka
pump, NATS group coordination), run as its components. A component is a coroutine function
run in a task the supervisor owns:

- it returns: the component has ended (asked to stop);
- it raises a transient error (a ``BrokerError``, ``StoreError``, ``BackpressureError``,
  ``OSError`` or ``TimeoutError``): logged (rate-limited) and started again after a backoff
  with full jitter, growing from ``initial_delay`` to ``max_delay``;
- it raises anything else (a bug, a ``ConfigurationError``, a refused message), or keeps
  failing for ``give_up_after`` seconds without one run lasting ``stable_after``: the
  component has failed. The supervisor records a :class:`ComponentFailedError` naming it
  and calls its ``on_failure`` callback; the owner decides what to do (``App.serve`` stops
  and raises it, ``async with app`` raises it on exit).

The supervisor keeps its tasks in a set rather than an ``asyncio.TaskGroup``: a task group
cancels the task that entered it when a child fails, and the task that starts an app is the
user's own; a component's failure never cancels anything but the component.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from ._logging import Throttled
from .errors import (
    BackpressureError,
    BrokerError,
    ComponentFailedError,
    ConfigurationError,
    MessageRefusedError,
    StoreError,
)

__all__ = [
    "Component",
    "ComponentState",
    "Health",
    "RestartPolicy",
    "Supervisor",
    "is_transient",
]

DEFAULT_INITIAL_DELAY = 0.1
DEFAULT_MAX_DELAY = 10.0
DEFAULT_GIVE_UP_AFTER = 300.0
DEFAULT_STABLE_AFTER = 10.0

_log = logging.getLogger("eventflow.supervisor")
_TRANSIENT = (BrokerError, StoreError, BackpressureError, OSError, TimeoutError)


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` may go away by itself (a broker or store outage), so the component
    that raised it is worth starting again (a group of errors, when all of them are)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_transient(e) for e in exc.exceptions)
    if isinstance(exc, MessageRefusedError | ConfigurationError):
        return False
    return isinstance(exc, _TRANSIENT)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a supervisor restarts a failing component (durations in seconds).

    - ``initial_delay`` / ``max_delay``: the backoff before restart number n is a random
      time up to ``min(max_delay, initial_delay * 2**(n-1))`` (full jitter).
    - ``give_up_after``: a component failing for this long, without a run that lasted
      ``stable_after`` in between, has failed (None: retry transient errors for ever).
    - ``stable_after``: a run lasting this long counts as recovered (the backoff and the
      failure streak start over).
    """

    initial_delay: float = DEFAULT_INITIAL_DELAY
    max_delay: float = DEFAULT_MAX_DELAY
    give_up_after: float | None = DEFAULT_GIVE_UP_AFTER
    stable_after: float = DEFAULT_STABLE_AFTER

    def __post_init__(self) -> None:
        if self.initial_delay < 0 or self.max_delay < self.initial_delay:
            raise ConfigurationError(
                "RestartPolicy needs 0 <= initial_delay <= max_delay "
                f"(got {self.initial_delay}, {self.max_delay})"
            )
        if self.give_up_after is not None and self.give_up_after <= 0:
            raise ConfigurationError("RestartPolicy.give_up_after must be > 0 seconds or None")
        if self.stable_after <= 0:
            raise ConfigurationError("RestartPolicy.stable_after must be > 0 seconds")

    def backoff(self, restart: int) -> float:
        """A random delay (full jitter) before restart number ``restart`` (1-based)."""
        cap = min(self.max_delay, self.initial_delay * 2.0 ** min(restart - 1, 30))
        return random.random() * cap


class ComponentState(StrEnum):
    """Where a component is in its life."""

    RUNNING = "running"
    RETRYING = "retrying"
    """It failed and waits for its restart."""
    FAILED = "failed"
    """It cannot recover; it is not restarted."""
    STOPPED = "stopped"
    """It ended (asked to stop) or was cancelled."""


@dataclass(frozen=True, slots=True)
class Health:
    """An owner's health: ``ok``, ``degraded`` (a component is failing and being restarted)
    or ``failed`` (one cannot recover), with a line per component that is not well."""

    status: str
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every component runs well."""
        return self.status == "ok"


class Component:
    """One supervised component: its name, state, restarts and last error."""

    def __init__(self, supervisor: Supervisor, name: str) -> None:
        self.name = name
        self.state = ComponentState.RUNNING
        self.restarts = 0
        self.last_error: BaseException | None = None
        self._supervisor = supervisor
        self._task: asyncio.Task[None] | None = None
        self.restarts_in_streak = 0
        self._failing_since: float | None = None  # loop time of the streak's first failure
        self._run_began = 0.0
        self._stopping = False  # its owner asked it to stop (stop() or the supervisor's close)
        self._finishing = False  # its owner asked it to end by itself (finish())
        self._restart_wait: asyncio.Future[None] | None = None  # set while in its backoff

    def __repr__(self) -> str:
        return f"<Component {self.name!r} {self.state.value} restarts={self.restarts}>"

    def degraded(self, now: float, stable_after: float) -> bool:
        """True while the component fails, or runs again but not yet for ``stable_after``."""
        if self.state is ComponentState.RETRYING:
            return True
        return (
            self.state is ComponentState.RUNNING
            and self._failing_since is not None
            and now - self._run_began < stable_after
        )

    def describe(self) -> str:
        """One line for logs, heartbeats and ``eventflow status``."""
        error = self.last_error
        why = f" ({type(error).__name__}: {error})" if error is not None else ""
        restarts = f", {self.restarts} restarts" if self.restarts else ""
        return f"{self.name}: {self.state.value}{restarts}{why}"

    async def wait(self) -> None:
        """Wait until the component's task has ended (it is never restarted after that)."""
        if self._task is not None:
            await asyncio.wait({self._task})

    def finish(self) -> None:
        """Let the component end by itself (its owner asked its run to return, as a draining
        consumer does): it is not restarted any more, and one waiting in its restart
        backoff ends at once (``STOPPED``). A run that fails with a transient error from
        now on is not restarted either; one that fails otherwise still fails. Idempotent."""
        self._finishing = True
        waiting = self._restart_wait
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def _wait_to_restart(self, delay: float) -> None:
        """Sleep ``delay`` seconds before the next run, or until :meth:`finish`."""
        if self._finishing:
            return
        waiting = self._restart_wait = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(delay):
                await waiting
        except TimeoutError:
            pass
        finally:
            self._restart_wait = None

    async def stop(self) -> None:
        """Cancel the component and wait for it to end. Idempotent."""
        task = self._task
        if task is None or task.done():
            return
        self._stopping = True
        task.cancel()
        await asyncio.wait({task})


class Supervisor:
    """Owns named components (see the module docstring); ``close()`` stops them all."""

    def __init__(
        self,
        name: str,
        policy: RestartPolicy | None = None,
        *,
        on_failure: Callable[[ComponentFailedError], object] | None = None,
    ) -> None:
        self.name = name
        self.policy = policy or RestartPolicy()
        self._on_failure = on_failure
        self._components: list[Component] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: ComponentFailedError | None = None
        self._failed = asyncio.Event()
        self._closed = False
        self._log = Throttled(_log)

    @property
    def components(self) -> tuple[Component, ...]:
        """The components running (or waiting to restart), and those that failed, in start
        order; one that ended is forgotten."""
        return tuple(self._components)

    @property
    def failure(self) -> ComponentFailedError | None:
        """The first component failure, if one happened."""
        return self._failure

    async def wait_failed(self) -> ComponentFailedError:
        """Wait for the first component failure and return it."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def health(self) -> Health:
        """``failed`` if a component failed, ``degraded`` while one is being restarted."""
        now = asyncio.get_running_loop().time()
        stable = self.policy.stable_after
        failed = [c for c in self._components if c.state is ComponentState.FAILED]
        degraded = [c for c in self._components if c.degraded(now, stable)]
        if failed:
            return Health("failed", tuple(c.describe() for c in failed + degraded))
        if degraded:
            return Health("degraded", tuple(c.describe() for c in degraded))
        return Health("ok")

    def spawn(
        self, name: str, run: Callable[[], Awaitable[None]], *, restart: bool = True
    ) -> Component:
        """Run ``run()`` as component ``name`` (``restart=False``: any error fails it)."""
        if self._closed:
            raise RuntimeError(f"supervisor {self.name!r} is closed; start a new one")
        component = Component(self, name)
        task = asyncio.get_running_loop().create_task(
            self._supervise(component, run, restart), name=f"eventflow:{name}"
        )
        component._task = task
        self._components.append(component)
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._ended(component, done))
        return component

    def _ended(self, component: Component, task: asyncio.Task[None]) -> None:
        # A stopped component is forgotten (a consumer subscribing again after each failure
        # would grow the list for ever); a failed one stays, to be reported.
        self._tasks.discard(task)
        if component.state is not ComponentState.FAILED:
            self._components.remove(component)

    async def close(self) -> None:
        """Cancel every component and wait for them to end. Idempotent."""
        self._closed = True
        for component in self._components:
            component._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _supervise(
        self, component: Component, run: Callable[[], Awaitable[None]], restart: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        policy = self.policy
        while True:
            component.state = ComponentState.RUNNING
            began = component._run_began = loop.time()
            # Stop requests are the component's own flag, not task.cancelling(): a task
            # group whose child fails after its body ended leaves a cancel request counted
            # on its parent for good (Python 3.11), which would read as a stop.
            try:
                await run()
            except asyncio.CancelledError as exc:
                if component._stopping:
                    component.state = ComponentState.STOPPED
                    raise  # stopped by its owner
                error: Exception = _unasked_cancel(exc)
            except Exception as exc:
                if component._stopping:
                    # Stopped by its owner, and its clean-up failed (a rollback on a dead
                    # connection, say): still a stop, not a failure to restart.
                    component.state = ComponentState.STOPPED
                    raise asyncio.CancelledError from exc
                error = exc
            else:
                component.state = ComponentState.STOPPED
                self._log.clear(component.name)
                return
            now = loop.time()
            if component._failing_since is None or now - began >= policy.stable_after:
                component._failing_since = now  # a new streak: the last run was stable
                component.restarts_in_streak = 0
            component.last_error = error
            failing_for = now - component._failing_since
            if not restart or not is_transient(error):
                self._fail(component, error, "it is not a transient error")
                return
            if component._finishing:  # asked to end: no restart
                component.state = ComponentState.STOPPED
                return
            if policy.give_up_after is not None and failing_for >= policy.give_up_after:
                self._fail(
                    component,
                    error,
                    f"it kept failing for {failing_for:.0f}s (give_up_after="
                    f"{policy.give_up_after:g}s)",
                )
                return
            component.state = ComponentState.RETRYING
            component.restarts += 1
            component.restarts_in_streak += 1
            delay = policy.backoff(component.restarts_in_streak)
            self._log.warning(
                component.name,
                "%s failed (%s: %s); restarting it in %.2fs (restart %d)",
                component.name,
                type(error).__name__,
                error,
                delay,
                component.restarts,
            )
            try:
                await component._wait_to_restart(delay)
            except asyncio.CancelledError:
                component.state = ComponentState.STOPPED  # stopped while waiting to restart
                raise
            if component._finishing:  # asked to end while it waited: no restart
                component.state = ComponentState.STOPPED
                return

    def _fail(self, component: Component, error: BaseException, why: str) -> None:
        component.state = ComponentState.FAILED
        failure = ComponentFailedError(
            component.name,
            f"{component.name} failed and cannot recover ({why}): {type(error).__name__}: "
            f"{error}; fix the cause and start it again",
        )
        failure.__cause__ = error
        _log.error("%s", failure, exc_info=error)
        if self._failure is None:
            self._failure = failure
            self._failed.set()
        if self._on_failure is not None:
            self._on_failure(failure)


def _unasked_cancel(exc: asyncio.CancelledError) -> Exception:
    """A cancellation that reached a component although nobody cancelled it (a bug in what
    it awaited), as an error the supervisor can report."""
    error = RuntimeError(f"cancelled from within ({exc or 'no message'})")
    error.__cause__ = exc
    return error
