"""``SqlLimitBackend``: cluster limits kept in the app's SQL store (PostgreSQL, or a SQLite
file for processes on one machine), through the ``Store`` port only.

Two tables, created on first use: ``ef_limits`` (one row per limit: the rate's next free
moment ``tat`` and the breaker's record with its version) and ``ef_limit_slots`` (one row
per held slot, with its expiry on the store's clock). An acquire is one transaction that
first upserts the limit's row, which serialises the acquires of one limit (PostgreSQL
locks the row until the commit; SQLite's write transactions are serial anyway), reads the
store's clock once it holds the row (not while it waited for it), then inserts the slot if
fewer than ``concurrency`` are live (one statement) and moves the rate's next free moment.
Every call runs in a context of its own, so a handler inside ``ctx.transaction()`` can take
a limit: its slot commits at once, apart from the handler's transaction.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import orjson

from ..errors import ConfigurationError
from ..ports import Store, Transaction
from .breaker import BreakerState
from .shared import Acquired
from .spec import Limit

__all__ = ["SqlLimitBackend"]

_T = TypeVar("_T")
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS ef_limits (name TEXT PRIMARY KEY, "
    "tat DOUBLE PRECISION NOT NULL DEFAULT 0, version BIGINT NOT NULL DEFAULT 0, "
    "breaker TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE IF NOT EXISTS ef_limit_slots (name TEXT NOT NULL, slot TEXT NOT NULL, "
    "expires DOUBLE PRECISION NOT NULL, PRIMARY KEY (name, slot))",
)
_SCHEMA_TRIES = 5


class SqlLimitBackend:
    """The ``LimitBackend`` of cluster limits without ``backend=``: the app's store."""

    def __init__(self, store: Store, clock: str) -> None:
        self.store = store
        self._now = clock
        self._lock_row = (
            "INSERT INTO ef_limits (name) VALUES ($1) ON CONFLICT (name) DO UPDATE "
            "SET tat = ef_limits.tat RETURNING tat"
        )
        # Read in a statement of its own once the row is locked: the lock statement's clock
        # is when it began, before waiting for the row, and a token reserved from then
        # would lie in the past and bunch with the next entry's.
        self._clock_row = f"SELECT {clock}"

    @classmethod
    def for_store(cls, store: Store, limit: str) -> SqlLimitBackend:
        """The backend over ``store``; refused for a store other processes do not share."""
        clock = store.clock.sql
        if not (store.durable and store.supports_sql) or clock is None:
            raise ConfigurationError(
                f"Limit({limit!r}, scope='cluster') is shared through the app's store, and "
                f"{store.url!r} is not shared by other processes: use a PostgreSQL store (a "
                "SQLite file for processes on one machine), or backend='redis://host:6379/0'"
            )
        return cls(store, clock)

    async def _run(self, work: Callable[[Transaction], Awaitable[_T]]) -> _T:
        """Run ``work`` in a transaction of its own, outside any the caller has open."""

        async def in_tx() -> _T:
            async with self.store.transaction() as tx:
                return await work(tx)

        task = asyncio.get_running_loop().create_task(in_tx(), context=contextvars.Context())
        return await task

    async def open(self) -> None:
        """Create the tables if missing (several processes may race to: retried)."""
        for attempt in range(_SCHEMA_TRIES):
            try:
                for statement in _SCHEMA:
                    await self._run(lambda tx, s=statement: tx.execute(s))  # type: ignore[misc]
                return
            except Exception:  # a unique violation of a concurrent CREATE, on PostgreSQL
                if attempt == _SCHEMA_TRIES - 1:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))

    async def close(self) -> None:
        """Nothing to close: the store is the app's."""

    async def acquire(self, limit: Limit, slot: str, max_wait: float) -> Acquired:
        """One transaction: lock the limit's row, count live slots, reserve a token, insert
        the slot."""

        async def work(tx: Transaction) -> Acquired:
            rows = await tx.fetch(self._lock_row, limit.name)
            tat = float(rows[0][0])
            now = float((await tx.fetch(self._clock_row))[0][0])
            wait = 0.0
            if limit.rate is not None:
                start = max(tat, now)
                wait = start - now - (limit.burst - 1) * limit.emission
                if wait > max_wait:
                    return Acquired(False, wait)
            if limit.concurrency is not None:
                # One statement: the slot is inserted only while fewer are live.
                taken = await tx.execute(
                    "INSERT INTO ef_limit_slots (name, slot, expires) SELECT $1, $2, $3 "
                    "WHERE (SELECT count(*) FROM ef_limit_slots "
                    "WHERE name = $1 AND expires > $4) < $5",
                    limit.name,
                    slot,
                    now + limit.ttl,
                    now,
                    limit.concurrency,
                )
                if not taken:
                    await tx.execute(
                        "DELETE FROM ef_limit_slots WHERE name = $1 AND expires <= $2",
                        limit.name,
                        now,
                    )
                    return Acquired(False)
            if limit.rate is not None:
                await tx.execute(
                    "UPDATE ef_limits SET tat = $2 WHERE name = $1",
                    limit.name,
                    max(tat, now) + limit.emission,
                )
            return Acquired(True, max(wait, 0.0))

        return await self._run(work)

    async def release(self, limit: Limit, slot: str) -> None:
        """Delete the slot's row."""
        await self._run(
            lambda tx: tx.execute(
                "DELETE FROM ef_limit_slots WHERE name = $1 AND slot = $2", limit.name, slot
            )
        )

    async def renew(self, limit: Limit, slots: Sequence[str]) -> None:
        """Move each held slot's expiry to ``ttl`` from now, in one transaction."""

        async def work(tx: Transaction) -> None:
            for slot in slots:
                await tx.execute(
                    f"UPDATE ef_limit_slots SET expires = {self._now} + $3 "
                    "WHERE name = $1 AND slot = $2",
                    limit.name,
                    slot,
                    limit.ttl,
                )

        await self._run(work)

    async def load_breaker(self, limit: Limit) -> tuple[BreakerState, int]:
        """The breaker's record and version."""
        rows = await self._run(
            lambda tx: tx.fetch(
                "SELECT version, breaker FROM ef_limits WHERE name = $1", limit.name
            )
        )
        if not rows or not rows[0][1]:
            return BreakerState(), int(rows[0][0]) if rows else 0
        data: dict[str, Any] = orjson.loads(rows[0][1])
        return BreakerState.from_json(data), int(rows[0][0])

    async def store_breaker(self, limit: Limit, state: BreakerState, version: int) -> bool:
        """Compare-and-set the breaker's record."""
        text = orjson.dumps(state.to_json()).decode()

        async def work(tx: Transaction) -> bool:
            await tx.execute(
                "INSERT INTO ef_limits (name) VALUES ($1) ON CONFLICT (name) DO NOTHING",
                limit.name,
            )
            rows = await tx.fetch(
                "UPDATE ef_limits SET breaker = $2, version = version + 1 "
                "WHERE name = $1 AND version = $3 RETURNING version",
                limit.name,
                text,
                version,
            )
            return bool(rows)

        return await self._run(work)
