"""The in-memory event log: streams, the global order, snapshots and appends in
transactions.

A real implementation of the event-store port for one process: appends are atomic and
version-checked, positions are gapless, ``subscribe`` follows live appends.

An append made inside ``store.transaction()`` (or ``ctx.transaction()``) commits with it or
not at all, as on the SQL stores. It is staged in the transaction and written at commit,
where its events get their positions (so a rollback leaves no gap and readers outside the
transaction never see it); reads of the stream inside the transaction (``read_stream``,
``stream_version``, ``expected_version``) see it, with position 0 until it commits (as
PostgreSQL numbers events only once committed). The transaction holds every stream it
staged an append to until it ends, as PostgreSQL's unique index holds a row being inserted:
another writer of that stream (an append outside the transaction, or in another one) waits
for it to end, then finds the stream as it left it (a ``ConcurrencyError`` if it expected
the old version). Two transactions that would wait for each other's streams are a deadlock:
the second to wait gets a ``StoreError`` at once, as PostgreSQL's deadlock detection
answers. Readers never wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from ...envelope import Envelope
from ...errors import ConcurrencyError, StoreError
from ...events import Event
from ...ports import RecordedEvent, Snapshot
from ...sourcing.append import prepare_append
from .transactions import MemoryTransaction, TransactionScope

__all__ = ["MemoryEventLog", "MemoryTransaction"]


class MemoryEventLog:
    """Streams and the global log, kept in lists; appends join the context's transaction."""

    def __init__(self) -> None:
        self._log: list[RecordedEvent] = []
        self._streams: dict[str, list[RecordedEvent]] = {}
        self._ids: set[str] = set()
        self._snapshots: dict[str, Snapshot] = {}
        self._writers: dict[str, MemoryTransaction] = {}  # stream -> tx staging appends to it
        self._subscribers: set[asyncio.Future[None]] = set()
        self._scope = TransactionScope(f"eventflow-memory-{id(self)}")

    def transaction(self) -> AbstractAsyncContextManager[MemoryTransaction]:
        """A transaction holding appends and eventflow's writes until the block exits
        normally (then all are applied at once), dropping them if it raises."""
        return self._transaction()

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[MemoryTransaction]:
        tx, token = self._scope.begin()
        try:
            try:
                yield tx
            except BaseException:
                tx.end()  # rolled back: nothing it held is written
                raise
            tx.commit()
        finally:
            tx.end()
            self._scope.forget(token)

    async def append(
        self,
        stream_id: str,
        events: Sequence[Event | Envelope],
        *,
        expected_version: int | None = None,
    ) -> int:
        """Append atomically (staged in the context's transaction, if one is open); see
        ``EventStore.append`` and the module docstring."""
        envelopes = prepare_append(stream_id, events)
        tx = self._scope.current()
        await self._wait_for_writer(stream_id, tx)
        stream = self._streams.get(stream_id, [])
        staged = tx.streams.get(stream_id, ()) if tx is not None else ()
        current = len(stream) + len(staged)
        fresh = [
            e
            for e in envelopes
            if e.id not in self._ids and (tx is None or e.id not in tx.staged_ids)
        ]
        if envelopes and not fresh:
            return current  # a retried append: every event is stored (or staged) already
        if expected_version is not None and expected_version != current:
            raise ConcurrencyError(stream_id, expected_version, current)
        if not fresh:
            return current
        if tx is None:
            self._write([(stream_id, env) for env in fresh])
        else:
            self._stage(tx, stream_id, fresh)
        return current + len(fresh)

    async def _wait_for_writer(self, stream_id: str, tx: MemoryTransaction | None) -> None:
        """Wait until no transaction but ``tx`` holds ``stream_id``."""
        while True:
            holder = self._writers.get(stream_id)
            if holder is None or holder is tx:
                return
            if tx is not None:
                waits: MemoryTransaction | None = holder
                while waits is not None:
                    if waits is tx:
                        raise StoreError(
                            f"deadlock appending to {stream_id!r}: a transaction holding it "
                            "waits for a stream this transaction holds; this one is given up "
                            "(try it again: the other can now go on)"
                        )
                    waits = waits.waiting_for
                tx.waiting_for = holder
            try:
                await holder.ended()
            finally:
                if tx is not None:
                    tx.waiting_for = None

    def _stage(self, tx: MemoryTransaction, stream_id: str, envelopes: list[Envelope]) -> None:
        if not tx.staged:
            tx.defer(lambda: self._write(tx.staged))
        if stream_id not in tx.streams:
            tx.streams[stream_id] = []
            self._writers[stream_id] = tx
            tx.on_end(lambda: self._release(stream_id, tx))
        tx.streams[stream_id].extend(envelopes)
        tx.staged.extend((stream_id, env) for env in envelopes)
        tx.staged_ids.update(env.id for env in envelopes)

    def _release(self, stream_id: str, tx: MemoryTransaction) -> None:
        if self._writers.get(stream_id) is tx:
            del self._writers[stream_id]

    def _write(self, appends: Sequence[tuple[str, Envelope]]) -> None:
        """Store committed events: each gets the next position and its stream's next
        version (the streams are held by their writer, so the versions are the ones its
        appends returned). An id stored meanwhile by a writer of another stream is skipped."""
        log, ids = self._log, self._ids
        for stream_id, env in appends:
            if env.id in ids:
                continue
            stream = self._streams.setdefault(stream_id, [])
            rec = RecordedEvent(stream_id, len(stream) + 1, len(log) + 1, env)
            stream.append(rec)
            log.append(rec)
            ids.add(env.id)
        subscribers, self._subscribers = self._subscribers, set()
        for waiter in subscribers:
            if not waiter.done():
                waiter.set_result(None)

    def _stream(self, stream_id: str) -> list[RecordedEvent]:
        """The stream as this context sees it: committed events, then those its transaction
        staged (position 0: not numbered before the commit)."""
        stream = self._streams.get(stream_id, [])
        tx = self._scope.current()
        staged = tx.streams.get(stream_id) if tx is not None else None
        if not staged:
            return list(stream)
        base = len(stream)
        return stream + [
            RecordedEvent(stream_id, base + i, 0, env) for i, env in enumerate(staged, start=1)
        ]

    async def read_stream(
        self,
        stream_id: str,
        *,
        from_version: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """One stream's events in version order (or reversed)."""
        stream = self._stream(stream_id)
        if backwards:
            top = len(stream) if from_version is None else min(from_version, len(stream))
            selected = stream[:top][::-1]
        else:
            selected = stream[(from_version or 1) - 1 :]
        for rec in selected[:limit] if limit is not None else selected:
            yield rec

    async def read_all(
        self, *, after: int = 0, limit: int | None = None
    ) -> AsyncIterator[RecordedEvent]:
        """Committed events after ``after`` in global order."""
        end = len(self._log) if limit is None else min(len(self._log), after + limit)
        for rec in self._log[after:end]:
            yield rec

    async def correlated(self, correlation_id: str, *, limit: int = 100_000) -> list[RecordedEvent]:
        """The committed events of one correlation in global order (a pass over the log in
        memory: no process but this one can read it)."""
        found = [r for r in self._log if r.envelope.correlation_id == correlation_id]
        return found[:limit]

    async def subscribe(self, *, after: int = 0) -> AsyncIterator[RecordedEvent]:
        """Catch up, then follow committed appends."""
        position = after
        log = self._log
        while True:
            while position < len(log):
                rec = log[position]
                position += 1
                yield rec
            # Registered before suspending: an append right after this check wakes it.
            waiter = asyncio.get_running_loop().create_future()
            self._subscribers.add(waiter)
            try:
                await waiter
            finally:
                self._subscribers.discard(waiter)

    async def stream_version(self, stream_id: str) -> int:
        """0 when the stream does not exist (its staged appends count inside the
        transaction that made them)."""
        tx = self._scope.current()
        staged = len(tx.streams.get(stream_id, ())) if tx is not None else 0
        return len(self._streams.get(stream_id, ())) + staged

    async def last_position(self) -> int:
        """0 when empty (committed events only)."""
        return len(self._log)

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        """Replace the stream's snapshot."""
        self._snapshots[snapshot.stream_id] = snapshot

    async def load_snapshot(self, stream_id: str) -> Snapshot | None:
        """The stream's snapshot, if any."""
        return self._snapshots.get(stream_id)
