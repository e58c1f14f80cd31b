"""``ProjectionRunner``: feeds one projection from the event store, live or by rebuild.

Live (``run``): hold the store lease ``projection:<name>`` (one active instance per name
across processes; other instances wait for the lease and take over when the holder stops,
dies or loses it), run the projection's ``setup(tx)``, read the checkpoint, follow
``store.subscribe(after=checkpoint)`` and handle the events in batches. Each batch runs in ONE
store transaction: the ``@on`` handlers of its events, then ``checkpoints.set(name,
last_position, tx=tx, lease=lease)``, so the projection's writes and its position commit
together, and only while the lease still has this runner's epoch: a runner that lost its
lease (paused, cut off) cannot commit a batch another runner handles too. A lost lease ends
``run()`` with ``LeaseLostError`` (the owner's supervisor starts it again: it waits for the
lease, then runs ``setup`` again and continues from the committed checkpoint).

Failures: a handler that raises (or an event that cannot be decoded for a handler) rolls the
batch back; the runner logs it with the event's position, stream and type, waits (exponential
backoff, full jitter) and retries from the committed checkpoint, forever. A poison event
stalls its projection, visibly (log, ``failures``, lag in ``status``), instead of being
skipped: skipping would make the live state differ from a rebuild. Fix the code, redeploy, and
the projection continues from the failing event.

State kept in Python attributes (on a store whose ``supports_sql`` is False, such as
``memory://``) is not transactional: when a batch fails there, the effects of the events
handled before the failing one stay, so the runner commits the checkpoint up to them (and
re-handles only from the failing event). A handler that mutates state and then raises leaves
that mutation: on ``memory://`` raise before mutating.

Rebuild (``rebuild``): under the same lease, run ``setup(tx)``, then, in one transaction,
the projection's ``reset(tx)`` and the deletion of its checkpoint; then replay ``read_all``
up to the store's current end in batches, exactly as live processing does (same batches
code, same fenced checkpoints). A live runner started afterwards continues from where the
rebuild stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ..errors import ConfigurationError, LeaseLostError
from ..events import EventRegistry, default_registry
from ..leases import Lease
from ..ports import RecordedEvent, Store, declared
from .projection import (
    Projection,
    ProjectionContext,
    ProjectionError,
    ProjectionHandlerError,
    ProjectionLockedError,
    ProjectionStatus,
    lease_name,
)

if TYPE_CHECKING:
    from ..telemetry.tracing import Tracing

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_RETRY_INITIAL_DELAY",
    "DEFAULT_RETRY_MAX_DELAY",
    "ProgressCallback",
    "ProjectionHandlerError",
    "ProjectionRunner",
    "ProjectionStatus",
]

DEFAULT_BATCH_SIZE = 500
"""Events handled per transaction (fewer when fewer are available)."""
DEFAULT_RETRY_INITIAL_DELAY = 0.1
"""Upper bound of the first sleep after a failed batch, in seconds."""
DEFAULT_RETRY_MAX_DELAY = 30.0
"""Upper bound of any sleep between retries of a failed batch, in seconds."""

ProgressCallback = Callable[[int, int], object]
"""``progress(position, end)``: called by ``rebuild`` after every batch (and once at 0)."""

_log = logging.getLogger("eventflow.projections")

_Item = RecordedEvent | Exception


class ProjectionRunner:
    """Runs one projection against one store: ``run()`` live, ``rebuild()``, ``status()``.

    ``batch_size`` events are handled per transaction. ``atomic_state`` says whether the
    projection's state is written through ``ctx.transaction()`` (rolled back with a failed
    batch); by default it is the store's ``supports_sql`` (False on ``memory://``: state in
    Python attributes). ``registry`` decodes events, including ``ctx.record.event`` (the
    default registry unless given).

    ``run()`` runs until cancelled or until ``stop()``; one runner runs at most once at a time.
    """

    def __init__(
        self,
        projection: Projection,
        store: Store,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        retry_initial_delay: float = DEFAULT_RETRY_INITIAL_DELAY,
        retry_max_delay: float = DEFAULT_RETRY_MAX_DELAY,
        atomic_state: bool | None = None,
        registry: EventRegistry | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        if not isinstance(projection, Projection):
            raise ConfigurationError(
                f"ProjectionRunner takes a Projection instance, got {projection!r}: "
                "pass StockLevels(), not StockLevels"
            )
        if batch_size < 1:
            raise ConfigurationError(f"batch_size must be >= 1, got {batch_size}")
        if retry_initial_delay < 0 or retry_max_delay < 0:
            raise ConfigurationError("retry delays must be >= 0 seconds")
        self.projection = projection
        self.store = store
        self.batch_size = batch_size
        self.retry_initial_delay = retry_initial_delay
        self.retry_max_delay = retry_max_delay
        if atomic_state is None:
            atomic_state = bool(declared(store, Store, "supports_sql"))
        self.atomic_state = atomic_state
        self._registry = registry or default_registry
        self._tracing = tracing
        self._handlers = projection.handlers()  # also checks the projection has a name
        self._active = False
        self._running = False
        self._stop_requested = False
        self._in_batch = False
        self._serving: asyncio.Task[None] | None = None
        self.failures = 0
        """Failed batches since this runner was created."""
        self.last_error: BaseException | None = None
        """The latest failure (a ``ProjectionHandlerError`` or a store error), if any."""
        self.failing_since: datetime | None = None
        """When the current streak of failures began (UTC); None once a batch commits."""

    @property
    def name(self) -> str:
        """The projection's name (its checkpoint and lease are named after it)."""
        return self.projection.name

    def problem(self) -> str | None:
        """While its batches keep failing: what fails, at which position and since when (a
        line for the app's health); None when it runs well."""
        since, error = self.failing_since, self.last_error
        if since is None or error is None:
            return None
        where, cause = "", error
        if isinstance(error, ProjectionHandlerError):
            where = f" on event @{error.position} ({error.event_type!r})"
            cause = error.__cause__ or error
        return (
            f"projection {self.name}: failing{where} since {since:%Y-%m-%d %H:%M:%SZ}, "
            f"{self.failures} failed attempts ({type(cause).__name__}: {cause})"
        )

    @property
    def active(self) -> bool:
        """True while this runner holds the projection's lease and processes events."""
        return self._active

    # -- live ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Wait for the projection's lease, run ``setup``, then follow the store until
        ``stop()`` or cancel.

        Cancelling rolls back the batch in progress (SQL stores); ``stop()`` lets it finish.
        Raises ``LeaseLostError`` when the lease is lost (its batch in progress is rolled back
        or refused); run it again to wait for the lease again.
        """
        if self._running:
            raise ProjectionError(
                f"the runner of projection {self.name!r} is already running; create one "
                "runner per task"
            )
        self._running = True
        self._stop_requested = False
        try:
            async with asyncio.TaskGroup() as tg:
                self._serving = tg.create_task(self._serve(), name=f"projection:{self.name}")
        except BaseExceptionGroup as group:
            raise _sole(group) from None
        finally:
            self._serving = None
            self._running = False

    def stop(self) -> None:
        """Ask ``run()`` to return after the batch in progress (at once when idle).

        Idempotent; a runner waiting for the lease stops waiting.
        """
        self._stop_requested = True
        if self._serving is not None and not self._in_batch:
            self._serving.cancel()

    async def _serve(self) -> None:
        async with self.store.leases.hold(lease_name(self.name)) as lease:
            await self._setup()
            self._active = True
            _log.info("projection %s: active (lease epoch %d)", self.name, lease.epoch)
            try:
                await self._serve_leased(lease)
            finally:
                self._active = False

    async def _setup(self) -> None:
        async with self.store.transaction() as tx:
            await self.projection.setup(tx)

    async def _serve_leased(self, lease: Lease) -> None:
        attempt = 0
        failed_at: int | None = None
        while not self._stop_requested:
            try:
                after = await self.store.checkpoints.get(self.name)
                await self._follow(after, lease)
                return
            except LeaseLostError:
                raise  # another instance holds the projection now: this one must stop
            except Exception as exc:
                self.failures += 1
                self.last_error = exc
                self.failing_since = self.failing_since or datetime.now(UTC)
                position = getattr(exc, "position", None)
                attempt = attempt + 1 if position == failed_at else 1
                failed_at = position
                cap = min(self.retry_max_delay, self.retry_initial_delay * 2 ** (attempt - 1))
                log = _log.error if attempt == 1 else _log.warning
                log(
                    "projection %s: %s (attempt %d; retrying in up to %.2fs)",
                    self.name,
                    exc,
                    attempt,
                    cap,
                    exc_info=attempt == 1,
                )
                await asyncio.sleep(random.random() * cap)

    async def _follow(self, after: int, lease: Lease) -> None:
        """Handle batches from ``subscribe(after=after)`` until stopped; raise on failure."""
        queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=2 * self.batch_size)
        failure: Exception | None = None
        async with asyncio.TaskGroup() as tg:
            reader = tg.create_task(self._read(after, queue), name=f"projection-read:{self.name}")
            try:
                pending: Exception | None = None
                while not self._stop_requested:
                    if pending is not None:
                        raise pending
                    batch, pending = await self._next_batch(queue)
                    self._in_batch = True
                    try:
                        await self._apply(batch, lease)
                    finally:
                        self._in_batch = False
            except Exception as exc:
                failure = exc
            finally:
                reader.cancel()
        if failure is not None:
            raise failure

    async def _read(self, after: int, queue: asyncio.Queue[_Item]) -> None:
        events = self.store.subscribe(after=after)
        try:
            async for rec in events:
                await queue.put(rec)
        except Exception as exc:  # a store failure: the processor raises it after the batch
            await queue.put(exc)
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _next_batch(
        self, queue: asyncio.Queue[_Item]
    ) -> tuple[list[RecordedEvent], Exception | None]:
        item = await queue.get()
        if isinstance(item, Exception):
            raise item
        batch = [item]
        while len(batch) < self.batch_size and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, Exception):
                return batch, item
            batch.append(item)
        return batch, None

    # -- one batch -------------------------------------------------------------------------

    async def _apply(self, batch: list[RecordedEvent], lease: Lease) -> None:
        """Handle ``batch`` and move the checkpoint to its end, in transactions that commit
        only if ``lease`` still holds. One lasts at most a third of the lease's ttl (the rest
        of the batch goes into the next): a store busy with one long transaction could not
        renew the lease in time (SQLite has one writer), and the batch would be refused for
        ever."""
        if self._tracing is not None:
            first, last = batch[0].position, batch[-1].position
            with self._tracing.projecting(self.name, len(batch), first, last):
                await self._apply_all(batch, lease)
        else:
            await self._apply_all(batch, lease)

    async def _apply_all(self, batch: list[RecordedEvent], lease: Lease) -> None:
        while batch:
            batch = batch[await self._apply_some(batch, lease) :]

    async def _apply_some(self, batch: list[RecordedEvent], lease: Lease) -> int:
        """Handle the start of ``batch`` (one event at least, more while within the time
        budget) and move the checkpoint past it, in one transaction; return how many."""
        handlers = self._handlers
        registry = self._registry
        decode = registry.decode_as
        checkpoints = self.store.checkpoints
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.store.leases.ttl / 3
        done = 0
        handling = True  # False once every event of this transaction was handled
        rec = batch[0]
        try:
            async with self.store.transaction() as tx:
                ctx = ProjectionContext(self.store, self.projection, tx)
                for rec in batch:
                    entry = handlers.get(rec.envelope.type)
                    if entry is not None:
                        event_cls, handler = entry
                        ctx.record = rec.with_registry(registry)
                        await handler(decode(rec.envelope, event_cls), ctx)
                    done += 1
                    if loop.time() >= deadline:
                        break
                handling = False
                await checkpoints.set(self.name, batch[done - 1].position, tx=tx, lease=lease)
            self.failing_since = None
        except BaseException as exc:
            if not self.atomic_state and done > 0 and not isinstance(exc, LeaseLostError):
                # Python state keeps the handled events' effects: record that they are in.
                async with self.store.transaction() as tx:
                    await checkpoints.set(self.name, batch[done - 1].position, tx=tx, lease=lease)
            if isinstance(exc, Exception) and handling:
                raise ProjectionHandlerError(self.name, rec, exc) from exc
            raise
        return done

    # -- rebuild ---------------------------------------------------------------------------

    async def rebuild(
        self, *, progress: ProgressCallback | None = None, lock_timeout: float | None = None
    ) -> int:
        """Drop the projection's state and replay the whole log; return the last position.

        Holds the projection's lease throughout (waiting for it, or raising
        ``ProjectionLockedError`` if it is not free within ``lock_timeout`` seconds). Runs
        ``setup(tx)``, then calls ``reset(tx)`` and deletes the checkpoint in one transaction,
        then handles ``read_all`` up to the store's position at the start in batches, calling
        ``progress(position, end)`` after each. A handler error stops the rebuild
        (``ProjectionHandlerError``); the checkpoint then marks the last good batch, so a live
        runner continues from there. A lost lease stops it with ``LeaseLostError``.
        """
        if self._active:
            raise ProjectionError(
                f"projection {self.name!r} is running in this runner; call stop() and wait "
                "for run() to return before rebuilding"
            )
        async with self._leased(lock_timeout) as lease:
            await self._setup()
            async with self.store.transaction() as tx:
                await self.projection.reset(tx)
                await self.store.checkpoints.delete(self.name, tx=tx, lease=lease)
            end = await self.store.last_position()
            position = 0
            if progress is not None:
                progress(position, end)
            # The next batch is read while this one is handled (overlapping the store's I/O).
            batches: asyncio.Queue[list[RecordedEvent] | Exception | None] = asyncio.Queue(2)
            failure: Exception | None = None
            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(self._read_batches(end, batches))
                try:
                    while (batch := await batches.get()) is not None:
                        if isinstance(batch, Exception):
                            raise batch
                        await self._apply(batch, lease)
                        position = batch[-1].position
                        if progress is not None:
                            progress(position, end)
                except Exception as exc:  # raised below, not wrapped in an ExceptionGroup
                    failure = exc
                finally:
                    reader.cancel()
            if failure is not None:
                raise failure
            _log.info("projection %s: rebuilt up to position %d", self.name, position)
            return position

    async def _read_batches(
        self, end: int, batches: asyncio.Queue[list[RecordedEvent] | Exception | None]
    ) -> None:
        batch: list[RecordedEvent] = []
        try:
            async for rec in self.store.read_all(after=0, limit=end):
                batch.append(rec)
                if len(batch) >= self.batch_size:
                    await batches.put(batch)
                    batch = []
        except Exception as exc:  # handed to the rebuild, which raises it
            await batches.put(exc)
            return
        if batch:
            await batches.put(batch)
        await batches.put(None)

    @contextlib.asynccontextmanager
    async def _leased(self, timeout: float | None) -> AsyncIterator[Lease]:
        name = lease_name(self.name)
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with asyncio.timeout(timeout):
                    lease = await stack.enter_async_context(self.store.leases.hold(name))
            except TimeoutError:
                holder = await self.store.leases.holder(name)
                raise ProjectionLockedError(
                    f"projection {self.name!r} is running in another instance (lease {name!r} "
                    f"is held by {holder or 'another instance'}); stop that app, or wait for it"
                ) from None
            yield lease

    # -- status ----------------------------------------------------------------------------

    async def is_locked(self, timeout: float | None = None) -> bool:
        """True if an instance (this runner or another) holds the projection's lease now,
        as the store records it; ``timeout`` bounds the wait for the store's answer
        (``TimeoutError`` past it)."""
        if self._active:
            return True
        async with asyncio.timeout(timeout):
            return await self.store.leases.holder(lease_name(self.name)) is not None

    async def status(self, *, probe_lock: float | None = None) -> ProjectionStatus:
        """The projection's checkpoint, the store's last position and the lag.

        ``running`` is this runner's state, or with ``probe_lock`` (seconds to wait for the
        store's answer), whether any instance holds the projection's lease (None if the
        store did not answer in time).
        """
        checkpoint = await self.store.checkpoints.get(self.name)
        last = await self.store.last_position()
        running: bool | None = self._active
        if not running and probe_lock is not None:
            try:
                running = await self.is_locked(probe_lock)
            except TimeoutError:
                running = None
        return ProjectionStatus(self.name, checkpoint, last, running)


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one error of a task group that ran one task (so callers see it unwrapped)."""
    return group.exceptions[0] if len(group.exceptions) == 1 else group
