"""``ProjectionRunner``: feeds one projection from the event store, live or by rebuild.

Live (``run``): take the store lock ``projection:<name>`` (one active instance per name
across processes; other instances wait on the lock and take over when the holder stops or
dies), read the checkpoint, follow ``store.subscribe(after=checkpoint)`` and handle the events
in batches. Each batch runs in ONE store transaction: the ``@on`` handlers of its events, then
``checkpoints.set(name, last_position, tx=tx)``, so the projection's writes and its position
commit together.

Failures: a handler that raises (or an event that cannot be decoded for a handler) rolls the
batch back; the runner logs it with the event's position, stream and type, waits (exponential
backoff, full jitter) and retries from the committed checkpoint, forever. A poison event
stalls its projection, visibly (log, ``failures``, lag in ``status``), instead of being
skipped: skipping would make the live state differ from a rebuild. Fix the code, redeploy, and
the projection continues from the failing event.

State kept in Python attributes (the ``memory://`` store) is not transactional: when a batch
fails there, the effects of the events handled before the failing one stay, so the runner
commits the checkpoint up to them (and re-handles only from the failing event). A handler
that mutates state and then raises leaves that mutation: on ``memory://`` raise before
mutating.

Rebuild (``rebuild``): under the same lock, in one transaction, call the projection's
``reset(tx)`` and delete its checkpoint; then replay ``read_all`` up to the store's current
end in batches, exactly as live processing does (same batches code, same checkpoints). A
live runner started afterwards continues from where the rebuild stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..errors import ConfigurationError
from ..events import EventRegistry, default_registry
from ..ports import RecordedEvent, Store
from .projection import (
    Projection,
    ProjectionContext,
    ProjectionError,
    ProjectionLockedError,
    lock_name,
)

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


class ProjectionHandlerError(ProjectionError):
    """A projection handler raised (or its event could not be decoded); the batch rolled back.

    ``position``, ``stream_id`` and ``event_type`` name the event; ``__cause__`` is the error.
    """

    def __init__(self, projection: str, record: RecordedEvent, cause: BaseException) -> None:
        super().__init__(
            f"projection {projection!r} failed on event @{record.position} "
            f"({record.envelope.type!r} in stream {record.stream_id!r}): "
            f"{type(cause).__name__}: {cause}; fix the handler (or the event's upcaster) and "
            "restart: the projection resumes from this event"
        )
        self.projection = projection
        self.position = record.position
        self.stream_id = record.stream_id
        self.event_type = record.envelope.type


@dataclass(frozen=True, slots=True)
class ProjectionStatus:
    """Where a projection stands: its checkpoint against the store's newest position."""

    name: str
    checkpoint: int
    last_position: int
    running: bool | None = None
    """True/False when known (this runner, or a lock probe), None when not checked."""

    @property
    def lag(self) -> int:
        """Events appended to the store that the projection has not handled yet."""
        return max(0, self.last_position - self.checkpoint)


class ProjectionRunner:
    """Runs one projection against one store: ``run()`` live, ``rebuild()``, ``status()``.

    ``batch_size`` events are handled per transaction. ``atomic_state`` says whether the
    projection's state is written through ``ctx.transaction()`` (rolled back with a failed
    batch); by default it is False on ``memory://`` stores (state in Python attributes) and
    True otherwise. ``registry`` decodes events (the default registry unless given).

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
            atomic_state = not str(getattr(store, "url", "")).startswith("memory:")
        self.atomic_state = atomic_state
        self._registry = registry or default_registry
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

    @property
    def name(self) -> str:
        """The projection's name (its checkpoint and lock are named after it)."""
        return self.projection.name

    @property
    def active(self) -> bool:
        """True while this runner holds the projection's lock and processes events."""
        return self._active

    # -- live ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Wait for the projection's lock, then follow the store until ``stop()`` or cancel.

        Cancelling rolls back the batch in progress (SQL stores); ``stop()`` lets it finish.
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
        finally:
            self._serving = None
            self._running = False

    def stop(self) -> None:
        """Ask ``run()`` to return after the batch in progress (at once when idle).

        Idempotent; a runner waiting for the lock stops waiting.
        """
        self._stop_requested = True
        if self._serving is not None and not self._in_batch:
            self._serving.cancel()

    async def _serve(self) -> None:
        async with self.store.lock(lock_name(self.name)):
            self._active = True
            _log.info("projection %s: active", self.name)
            try:
                await self._serve_locked()
            finally:
                self._active = False

    async def _serve_locked(self) -> None:
        attempt = 0
        failed_at: int | None = None
        while not self._stop_requested:
            try:
                after = await self.store.checkpoints.get(self.name)
                await self._follow(after)
                return
            except Exception as exc:
                self.failures += 1
                self.last_error = exc
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

    async def _follow(self, after: int) -> None:
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
                        await self._apply(batch)
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

    async def _apply(self, batch: list[RecordedEvent]) -> None:
        """Handle ``batch`` and move the checkpoint to its end, in one transaction."""
        handlers = self._handlers
        decode = self._registry.decode_as
        checkpoints = self.store.checkpoints
        done = 0
        rec = batch[0]
        try:
            async with self.store.transaction() as tx:
                ctx = ProjectionContext(self.store, self.projection, tx)
                for rec in batch:
                    entry = handlers.get(rec.envelope.type)
                    if entry is not None:
                        event_cls, handler = entry
                        ctx.record = rec
                        await handler(decode(rec.envelope, event_cls), ctx)
                    done += 1
                await checkpoints.set(self.name, batch[-1].position, tx=tx)
        except BaseException as exc:
            if not self.atomic_state and done > 0:
                # Python state keeps the handled events' effects: record that they are in.
                async with self.store.transaction() as tx:
                    await checkpoints.set(self.name, batch[done - 1].position, tx=tx)
            if isinstance(exc, Exception) and done < len(batch):
                raise ProjectionHandlerError(self.name, rec, exc) from exc
            raise

    # -- rebuild ---------------------------------------------------------------------------

    async def rebuild(
        self, *, progress: ProgressCallback | None = None, lock_timeout: float | None = None
    ) -> int:
        """Drop the projection's state and replay the whole log; return the last position.

        Holds the projection's lock throughout (waiting for it, or raising
        ``ProjectionLockedError`` after ``lock_timeout`` seconds). Calls ``reset(tx)`` and
        deletes the checkpoint in one transaction, then handles ``read_all`` up to the store's
        position at the start in batches, calling ``progress(position, end)`` after each.
        A handler error stops the rebuild (``ProjectionHandlerError``); the checkpoint then
        marks the last good batch, so a live runner continues from there.
        """
        if self._active:
            raise ProjectionError(
                f"projection {self.name!r} is running in this runner; call stop() and wait "
                "for run() to return before rebuilding"
            )
        async with self._locked(lock_timeout):
            async with self.store.transaction() as tx:
                await self.projection.reset(tx)
                await self.store.checkpoints.delete(self.name, tx=tx)
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
                        await self._apply(batch)
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
    async def _locked(self, timeout: float | None) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with asyncio.timeout(timeout):
                    await stack.enter_async_context(self.store.lock(lock_name(self.name)))
            except TimeoutError:
                raise ProjectionLockedError(
                    f"projection {self.name!r} is locked by another instance (a running app "
                    f"holds {lock_name(self.name)!r}); stop that app, or wait for it"
                ) from None
            yield

    # -- status ----------------------------------------------------------------------------

    async def is_locked(self, timeout: float = 0.5) -> bool:
        """True if another instance holds the projection's lock (probed for ``timeout`` s).

        A free lock is taken and released at once; without a try-lock in the store port the
        probe waits up to ``timeout`` seconds before concluding the lock is held.
        """
        if self._active:
            return True
        try:
            async with self._locked(timeout):
                return False
        except ProjectionLockedError:
            return True

    async def status(self, *, probe_lock: float | None = None) -> ProjectionStatus:
        """The projection's checkpoint, the store's last position and the lag.

        ``running`` is this runner's state, or with ``probe_lock`` seconds, whether any
        instance holds the lock (see ``is_locked``).
        """
        checkpoint = await self.store.checkpoints.get(self.name)
        last = await self.store.last_position()
        running = self._active or (
            await self.is_locked(probe_lock) if probe_lock is not None else False
        )
        return ProjectionStatus(self.name, checkpoint, last, running)
