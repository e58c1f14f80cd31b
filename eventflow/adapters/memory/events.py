"""The in-memory event store, checkpoints, outbox, transactions and leases.

A real implementation of the event-store ports for one process: appends are atomic and
version-checked, positions are gapless, ``subscribe`` follows live appends. Transactions
buffer eventflow's own writes (checkpoints, outbox, dedup entries) and apply them on
commit; they have no SQL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any

from ...envelope import Envelope
from ...errors import ConcurrencyError, ConfigurationError
from ...events import Event
from ...leases import DEFAULT_LEASE_TTL, Lease, Wakeups, hold_lease, new_owner
from ...ports import OutboxMessage, RecordedEvent, Snapshot, Transaction
from ...sourcing.append import prepare_append

__all__ = [
    "MemoryCheckpoints",
    "MemoryEventLog",
    "MemoryLeases",
    "MemoryOutbox",
    "MemoryTransaction",
]

_WAIT_POLL = 1.0  # a contender is woken at release; this only bounds each wait


class MemoryTransaction:
    """Buffers writes until commit; SQL is not available on the memory store."""

    def __init__(self) -> None:
        self._on_commit: list[Callable[[], object]] = []

    def defer(self, action: Callable[[], object]) -> None:
        """Run ``action`` when the transaction commits."""
        self._on_commit.append(action)

    def commit(self) -> None:
        """Apply the buffered writes."""
        actions, self._on_commit = self._on_commit, []
        for action in actions:
            action()

    async def execute(self, sql: str, *args: Any) -> Any:
        """Not available: the memory store has no SQL."""
        raise ConfigurationError(
            "the memory:// store has no SQL; use sqlite:///path.db or postgresql://... to "
            "write your own tables in ctx.transaction()"
        )

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Not available: the memory store has no SQL."""
        return await self.execute(sql, *args)  # type: ignore[no-any-return]


def _defer(tx: Transaction | None, action: Callable[[], object]) -> None:
    if tx is None:
        action()
    elif isinstance(tx, MemoryTransaction):
        tx.defer(action)
    else:
        raise ConfigurationError("a memory store write was given another store's transaction")


class MemoryEventLog:
    """Streams and the global log, kept in lists."""

    def __init__(self) -> None:
        self._log: list[RecordedEvent] = []
        self._streams: dict[str, list[RecordedEvent]] = {}
        self._ids: set[str] = set()
        self._snapshots: dict[str, Snapshot] = {}
        self._appended = asyncio.Condition()

    async def append(
        self,
        stream_id: str,
        events: Sequence[Event | Envelope],
        *,
        expected_version: int | None = None,
    ) -> int:
        """Append atomically; see ``EventStore.append``."""
        stream = self._streams.get(stream_id, [])
        envelopes = prepare_append(stream_id, events)
        fresh = [e for e in envelopes if e.id not in self._ids]
        current = len(stream)
        if envelopes and not fresh:
            return current  # a retried append: every event is stored already
        if expected_version is not None and expected_version != current:
            raise ConcurrencyError(stream_id, expected_version, current)
        if not fresh:
            return current
        self._streams[stream_id] = stream
        for env in fresh:
            rec = RecordedEvent(stream_id, len(stream) + 1, len(self._log) + 1, env)
            stream.append(rec)
            self._log.append(rec)
            self._ids.add(env.id)
        async with self._appended:
            self._appended.notify_all()
        return len(stream)

    async def read_stream(
        self,
        stream_id: str,
        *,
        from_version: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """One stream's events in version order (or reversed)."""
        stream = list(self._streams.get(stream_id, ()))
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
        """Events after ``after`` in global order."""
        end = len(self._log) if limit is None else min(len(self._log), after + limit)
        for rec in self._log[after:end]:
            yield rec

    async def subscribe(self, *, after: int = 0) -> AsyncIterator[RecordedEvent]:
        """Catch up, then follow live appends."""
        position = after
        while True:
            while position < len(self._log):
                rec = self._log[position]
                position += 1
                yield rec
            async with self._appended:
                while len(self._log) <= position:
                    await self._appended.wait()

    async def stream_version(self, stream_id: str) -> int:
        """0 when the stream does not exist."""
        return len(self._streams.get(stream_id, ()))

    async def last_position(self) -> int:
        """0 when empty."""
        return len(self._log)

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        """Replace the stream's snapshot."""
        self._snapshots[snapshot.stream_id] = snapshot

    async def load_snapshot(self, stream_id: str) -> Snapshot | None:
        """The stream's snapshot, if any."""
        return self._snapshots.get(stream_id)


class MemoryLeases:
    """Leases in this process (the memory store lives in one): held until released, each
    holding with the next epoch of its name. A contender waits on an event set at release,
    not on a poll. The memory store never expires a lease: its holder's renewals cannot
    fail, and a holder whose loop does not run stops every task of the store with it."""

    def __init__(self, ttl: float = DEFAULT_LEASE_TTL) -> None:
        self.ttl = ttl
        self.owner = f"memory:{new_owner()}"
        self.poll = _WAIT_POLL
        self._held: dict[str, tuple[str, int]] = {}  # name -> (owner, epoch) while held
        self._last: dict[str, tuple[str, int]] = {}  # name -> the latest (owner, epoch)
        self._released = Wakeups()

    def hold(self, name: str) -> AbstractAsyncContextManager[Lease]:
        """Wait for the lease on ``name`` and hold it for the block (see ``Leases``)."""
        return hold_lease(self, name, owner=self.owner, ttl=self.ttl, poll=self.poll)

    async def holder(self, name: str) -> str | None:
        """The owner holding ``name``, or None."""
        held = self._held.get(name)
        return None if held is None else held[0]

    async def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """Take ``name`` if nobody holds it; return its new epoch."""
        if name in self._held:
            return None
        epoch = self._last.get(name, ("", 0))[1] + 1
        self._held[name] = self._last[name] = (owner, epoch)
        return epoch

    async def renew(self, name: str, owner: str, epoch: int, ttl: float) -> bool:
        """True while ``(owner, epoch)`` holds ``name``."""
        return self._held.get(name) == (owner, epoch)

    async def release(self, name: str, owner: str, epoch: int) -> None:
        """Let ``name`` go and wake its contenders."""
        if self._held.get(name) == (owner, epoch):
            del self._held[name]
            self._released.wake(name)

    async def wait(self, name: str, timeout: float) -> None:
        """Return at once if ``name`` is free, else when it is released (or ``timeout``)."""
        if name in self._held:  # no suspension between this check and the waiter's start
            await self._released.wait(name, timeout)

    def check(self, lease: Lease) -> None:
        """Raise ``lease.error()`` unless ``lease`` is the latest holding of its name."""
        if self._last.get(lease.name) != (lease.owner, lease.epoch):
            raise lease.error()


class MemoryCheckpoints:
    """Checkpoints in a dict; writes made with a lease are fenced by ``leases``."""

    def __init__(self, leases: MemoryLeases) -> None:
        self._positions: dict[str, int] = {}
        self._leases = leases

    async def get(self, name: str) -> int:
        """0 if never set."""
        return self._positions.get(name, 0)

    async def set(
        self,
        name: str,
        position: int,
        *,
        tx: Transaction | None = None,
        lease: Lease | None = None,
    ) -> None:
        """Set now, or when ``tx`` commits; with ``lease``, refused unless it still holds.

        The epoch is checked when the write is made: in one process a holding cannot end
        before the block that holds it, so it still holds at the commit of ``tx``."""
        if lease is not None:
            self._leases.check(lease)
        _defer(tx, lambda: self._positions.__setitem__(name, position))

    async def list(self) -> dict[str, int]:
        """Every checkpoint."""
        return dict(self._positions)

    async def delete(
        self, name: str, *, tx: Transaction | None = None, lease: Lease | None = None
    ) -> None:
        """Forget ``name``; fenced like ``set``."""
        if lease is not None:
            self._leases.check(lease)
        _defer(tx, lambda: self._positions.pop(name, None))


class MemoryOutbox:
    """Queued outgoing messages; removals made with a lease are fenced by ``leases``."""

    def __init__(self, leases: MemoryLeases) -> None:
        self._messages: dict[int, OutboxMessage] = {}
        self._seq = 0
        self._leases = leases
        self.added = asyncio.Event()

    def relaying(self) -> AbstractAsyncContextManager[None]:
        """Nothing to do: the outbox is this process's alone (see ``Outbox.relaying``)."""
        return nullcontext()

    async def add(
        self, messages: Sequence[tuple[str, Envelope]], *, tx: Transaction | None = None
    ) -> None:
        """Queue now, or when ``tx`` commits."""

        def apply() -> None:
            for topic, env in messages:
                self._seq += 1
                self._messages[self._seq] = OutboxMessage(
                    self._seq, topic, env.key, env.to_bytes(), env.id
                )
            self.added.set()

        _defer(tx, apply)

    async def pending(self, limit: int = 100) -> list[OutboxMessage]:
        """Oldest first."""
        return list(self._messages.values())[:limit]

    async def remove(self, seqs: Sequence[int], *, lease: Lease | None = None) -> None:
        """Delete sent messages; with ``lease``, refused unless it still holds."""
        if lease is not None:
            self._leases.check(lease)
        for seq in seqs:
            self._messages.pop(seq, None)
