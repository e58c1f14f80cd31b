"""In-memory store: dedup, dead letters and heartbeats kept in this process only.

Real implementations of the ports (they pass the same contract suites as the SQL ones),
bounded where they could grow without limit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from ...errors import AlreadyHandled
from ...ports import DeadLetter, Heartbeat, Transaction
from ...urls import url_options
from .attempts import MemoryAttempts
from .events import MemoryEventLog
from .leases import MemoryCheckpoints, MemoryLeases
from .outbox import MemoryOutbox
from .transactions import MemoryTransaction

if TYPE_CHECKING:
    from ...supervision import Supervisor

__all__ = [
    "MemoryClock",
    "MemoryDeadLetterStore",
    "MemoryDedupStore",
    "MemoryHeartbeats",
    "MemoryStore",
]

DEFAULT_DEDUP_CAPACITY = 1_000_000


class MemoryDedupStore:
    """Remembers handled (group, id) pairs: per group, the newest ``capacity`` of them (the
    oldest is forgotten first)."""

    def __init__(self, capacity: int = DEFAULT_DEDUP_CAPACITY) -> None:
        self.capacity = capacity
        # Per group: the ids, and the same ids in marking order, for eviction (a deque: a
        # dict's first key is found by scanning the slots its earlier deletions emptied).
        # Plain ids, not (group, id) pairs: no tuple to build and hash per message.
        self._groups: dict[str, tuple[set[str], deque[str]]] = {}
        # Per group: id -> the compensation that cancelled it (rare: a dict made on demand).
        self._cancelled: dict[str, dict[str, str]] = {}

    async def seen(self, group: str, message_id: str) -> bool:
        """True if ``message_id`` was marked for ``group`` and not yet evicted."""
        return self.has(group, message_id)

    async def seen_many(self, group: str, message_ids: Sequence[str]) -> set[str]:
        """The ids of ``message_ids`` marked for ``group`` and not yet evicted."""
        state = self._groups.get(group)
        return set() if state is None else state[0].intersection(message_ids)

    def has(self, group: str, message_id: str) -> bool:
        """``seen`` as a plain call (a memory transaction's own check)."""
        state = self._groups.get(group)
        return state is not None and message_id in state[0]

    async def mark(self, group: str, message_id: str) -> None:
        """Record the pair; evicts the group's oldest entry when over capacity."""
        self.record(group, message_id)

    async def mark_new(
        self, group: str, message_id: str, *, cancelled_by: str | None = None
    ) -> bool:
        """Record the pair unless it is there; True if this call recorded it."""
        return self.record(group, message_id, cancelled_by=cancelled_by)

    async def cancelled_by(self, group: str, message_id: str) -> str | None:
        """The compensation that cancelled the pair, if one did (and it is not evicted)."""
        cancelled = self._cancelled.get(group)
        return cancelled.get(message_id) if cancelled is not None else None

    def record(self, group: str, message_id: str, *, cancelled_by: str | None = None) -> bool:
        """``mark_new`` as a plain call: a memory transaction runs it as it commits (its
        commit is not a coroutine). The first record of a pair is kept."""
        state = self._groups.get(group)
        if state is None:
            state = self._groups[group] = (set(), deque())
        ids, order = state
        if message_id in ids:
            return False
        ids.add(message_id)
        order.append(message_id)
        if cancelled_by is not None:
            self._cancelled.setdefault(group, {})[message_id] = cancelled_by
        if len(order) > self.capacity:
            oldest = order.popleft()
            ids.discard(oldest)
            cancelled = self._cancelled.get(group)
            if cancelled is not None:
                cancelled.pop(oldest, None)
        return True

    async def open(self) -> None:
        """Nothing to connect to."""

    async def close(self) -> None:
        """Nothing to release."""

    def __len__(self) -> int:
        return sum(len(ids) for ids, _ in self._groups.values())


class MemoryDeadLetterStore:
    """Dead letters in a dict, in insertion (failure) order."""

    def __init__(self) -> None:
        self._letters: dict[str, DeadLetter] = {}

    async def add(self, letter: DeadLetter) -> None:
        """Store ``letter``."""
        self._letters[letter.id] = letter

    async def list(self, *, group: str | None = None, limit: int = 100) -> list[DeadLetter]:
        """Oldest first, optionally one group's."""
        out = [d for d in self._letters.values() if group is None or d.group == group]
        return out[:limit]

    async def get(self, letter_id: str) -> DeadLetter | None:
        """One letter or None."""
        return self._letters.get(letter_id)

    async def remove(self, letter_ids: Sequence[str]) -> int:
        """Delete; return how many existed."""
        return sum(self._letters.pop(i, None) is not None for i in letter_ids)

    async def count(self) -> dict[str, int]:
        """Letters per group."""
        counts: dict[str, int] = {}
        for d in self._letters.values():
            counts[d.group] = counts.get(d.group, 0) + 1
        return counts


class MemoryHeartbeats:
    """Heartbeats of the apps in this process."""

    def __init__(self) -> None:
        self._beats: dict[str, Heartbeat] = {}

    async def beat(self, heartbeat: Heartbeat) -> None:
        """Insert or replace."""
        self._beats[heartbeat.instance] = heartbeat

    async def list(self) -> list[Heartbeat]:
        """Newest first."""
        return sorted(self._beats.values(), key=lambda h: h.last_seen, reverse=True)

    async def remove(self, instance: str) -> None:
        """Forget an instance."""
        self._beats.pop(instance, None)

    async def prune(self, older_than: float) -> int:
        """Forget instances silent for ``older_than`` seconds."""
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than)
        stale = [i for i, h in self._beats.items() if h.last_seen < cutoff]
        for instance in stale:
            del self._beats[instance]
        return len(stale)


class MemoryClock:
    """The memory store's clock (``Store.clock``): ``source()``, in Unix seconds, the host's
    ``time.time`` unless replaced (a test kit puts a virtual clock there:
    ``store.clock.source = virtual.time``). Its transactions run no SQL, so ``sql`` is None."""

    sql: str | None = None

    def __init__(self, source: Callable[[], float] = time.time) -> None:
        self.source = source

    async def now(self, tx: Transaction | None = None) -> float:
        """``source()``: no I/O."""
        return self.source()


class MemoryStore(MemoryEventLog):
    """The ``memory://`` store: everything lives and dies with the process.

    ``clock``: what ``store.clock`` reads (``time.time`` by default; see
    :class:`MemoryClock`)."""

    durable = False
    """Its data lives in this process only."""
    supports_sql = False
    """Its transactions buffer eventflow's writes and run no SQL."""

    def __init__(self, url: str = "memory://", *, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.url = url
        self.clock = MemoryClock(clock)
        self.dedup = MemoryDedupStore()
        self.dead_letters = MemoryDeadLetterStore()
        self.heartbeats = MemoryHeartbeats()
        self.leases = MemoryLeases(self._scope)
        self.checkpoints = MemoryCheckpoints(self.leases, self._scope)
        self.outbox = MemoryOutbox(self.leases, self._scope)
        self.attempts = MemoryAttempts()
        # Dedup entries recorded by open transactions: (group, id) -> the transaction. A
        # second one recording the pair waits for it to end, as a SQL store's insert waits.
        self._claims: dict[tuple[str, str], MemoryTransaction] = {}

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        """``memory://``: it takes no options, so any query option is refused."""
        url_options(url, (), kind="memory store")
        return cls(url)

    async def mark_handled(
        self, group: str, message_id: str, tx: Transaction, *, cancelled_by: str | None = None
    ) -> None:
        """Record a dedup entry when ``tx`` commits; raise ``AlreadyHandled`` if the pair is
        recorded. A pair recorded by another open transaction waits for it to end (then
        raises if it committed), so two transactions never both record one pair."""
        joined = self._scope.of(tx)
        assert joined is not None  # of() returns the transaction it was given
        key = (group, message_id)
        while (owner := self._claims.get(key)) is not None and owner is not joined:
            await owner.ended()
        if owner is not None or self.dedup.has(group, message_id):
            raise AlreadyHandled(group, message_id)
        self._claims[key] = joined

        def release() -> None:
            del self._claims[key]

        joined.on_end(release)
        joined.defer(lambda: self.dedup.record(group, message_id, cancelled_by=cancelled_by))

    async def open(self, supervisor: Supervisor | None = None) -> None:
        """Nothing to connect to."""

    async def close(self) -> None:
        """Nothing to release (state stays until the object is dropped)."""

    async def __aenter__(self) -> MemoryStore:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
