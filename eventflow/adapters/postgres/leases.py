"""The PostgreSQL store's leases: rows of ``ef_leases`` timed by the server's clock.

A row per name holds its owner, its epoch (the fencing token) and when it expires
(``now()`` of the server, so the holders' clocks do not matter). Taking a lease that is free
or expired bumps the epoch in one statement; renewing extends it while ``(owner, epoch)``
still holds it; releasing expires it, keeping the epoch, and notifies
``ef_lease_released``, which the store's listener connection follows in every process, so
contenders try again at once instead of at their next poll.

A write made under a lease (see :data:`FENCE`), or a transaction fenced by one
(``fence``), locks the row ``FOR SHARE`` in the write's own transaction and writes only if
the epoch is still the lease's. A takeover updates the
row, so it waits for that transaction, and the write waits for a takeover under way and then
sees its new epoch: no takeover can commit between the check and the write.

Nothing here depends on a connection staying up (no session state, no advisory lock): a
holder whose connections are killed reconnects and keeps its lease as long as a renewal
gets through within ``ttl``. Renewals and releases run on a connection of the leases' own
(one statement at a time), so a pool taken up by the process's own slow transactions never
starves them; taking a lease and looking up its holder use the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from ...errors import ConfigurationError, StoreError
from ...leases import FENCE_NEEDS_TX, Lease, Wakeups, hold_lease, new_owner
from ...ports import Transaction
from .db import DRIVER_ERRORS, PostgresDatabase

__all__ = ["FENCE", "LEASE_CHANNEL", "PostgresLeases", "fence_args", "writing"]

LEASE_CHANNEL = "ef_lease_released"
"""The channel releases are notified on (payload ``schema:name``)."""

_POLL = 1.0  # at most this long between a contender's tries, notification or not

FENCE = "fence AS (SELECT 1 FROM ef_leases WHERE name = $1 AND owner = $2 AND epoch = $3 FOR SHARE)"
"""A ``WITH`` query that holds one row while the lease given as ``$1..$3`` (see
:func:`fence_args`) still holds, locking it against takeovers until the transaction ends."""


_ACQUIRE = (
    "INSERT INTO ef_leases AS l (name, owner, epoch, expires_at) "
    "VALUES ($1, $2, 1, now() + make_interval(secs => $3)) "
    "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, epoch = l.epoch + 1, "
    "expires_at = excluded.expires_at WHERE l.expires_at <= now() RETURNING epoch"
)
_RENEW = (
    "UPDATE ef_leases SET expires_at = now() + make_interval(secs => $4) "
    "WHERE name = $1 AND owner = $2 AND epoch = $3 AND expires_at > now()"
)
_RELEASE = (
    "WITH gone AS (UPDATE ef_leases SET expires_at = '-infinity' "
    "WHERE name = $1 AND owner = $2 AND epoch = $3 RETURNING name) "
    f"SELECT pg_notify('{LEASE_CHANNEL}', $4 || ':' || name) FROM gone"
)
_HOLDER = "SELECT owner FROM ef_leases WHERE name = $1 AND expires_at > now()"
_FENCE_TX = f"WITH {FENCE} SELECT 1 FROM fence"


def fence_args(lease: Lease) -> tuple[str, str, int]:
    """The parameters ``$1..$3`` of :data:`FENCE` for ``lease``."""
    return lease.name, lease.owner, lease.epoch


@asynccontextmanager
async def writing(db: PostgresDatabase, what: str, tx: object = None) -> AsyncIterator[Any]:
    """The connection a write that may be fenced (a checkpoint, an outbox removal) runs on
    (``tx``'s when given); driver errors (a connection killed, the server restarting)
    become a ``StoreError`` saying what failed."""
    try:
        async with db.connection(tx) as conn:
            yield conn
    except DRIVER_ERRORS as exc:
        raise StoreError(
            f"could not {what} on PostgreSQL: {type(exc).__name__}: {exc}; the write was "
            "not made, try it again once the server answers"
        ) from exc


class PostgresLeases:
    """``store.leases`` of the PostgreSQL store (see the module docstring). Every statement
    runs on a pooled connection of its own, never in a caller's transaction: a lease taken
    inside a transaction that rolls back would be held by nobody for a whole ttl."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db
        self.ttl = db.config.lease_ttl
        self.owner = new_owner()
        self.poll = min(_POLL, self.ttl / 4)
        self._schema = db.config.schema
        self._released = Wakeups()
        # Releases notified per name, and how many there were when this process last tried
        # to take it: a release notified between a failed try and the wait that follows it
        # ends that wait at once instead of being missed.
        self._notified: dict[str, int] = {}
        self._tried_at: dict[str, int] = {}
        self._own: Any = None  # the connection renewals and releases run on
        self._own_lock = asyncio.Lock()

    def hold(self, name: str) -> AbstractAsyncContextManager[Lease]:
        """Wait for the lease on ``name`` and keep it renewed for the block (see ``Leases``)."""
        return hold_lease(self, name, owner=self.owner, ttl=self.ttl, poll=self.poll)

    async def holder(self, name: str) -> str | None:
        """The owner holding ``name`` now, or None when it is free or expired."""
        async with self._connection("look up lease", name) as conn:
            owner: str | None = await conn.fetchval(_HOLDER, name)
        return owner

    async def fence(self, lease: Lease, tx: Transaction) -> None:
        """Refuse ``tx`` unless ``lease`` still has its epoch: one ``SELECT ... FOR SHARE``
        of the lease's row inside ``tx``, which a takeover then waits for until ``tx`` ends
        (see ``Leases.fence``)."""
        if tx is None:
            raise ConfigurationError(FENCE_NEEDS_TX)
        async with writing(self._db, f"fence by lease {lease.name!r}", tx) as conn:
            held = await conn.fetchval(_FENCE_TX, *fence_args(lease))
        if held is None:
            error = lease.error()
            self._db.doom(tx, error)
            raise error

    async def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """Take ``name`` if it is free or expired; return its new epoch, or None."""
        self._tried_at[name] = self._notified.get(name, 0)
        async with self._connection("take lease", name) as conn:
            epoch: int | None = await conn.fetchval(_ACQUIRE, name, owner, float(ttl))
        return epoch

    async def renew(self, name: str, owner: str, epoch: int, ttl: float) -> bool:
        """Extend the lease by ``ttl`` if ``(owner, epoch)`` holds it and it has not expired."""
        async with self._own_connection("renew lease", name) as conn:
            status = await conn.execute(_RENEW, name, owner, epoch, float(ttl))
        return bool(status == "UPDATE 1")

    async def release(self, name: str, owner: str, epoch: int) -> None:
        """Expire the lease (keeping its epoch) if ``(owner, epoch)`` holds it, and notify
        the contenders of every process."""
        async with self._own_connection("release lease", name) as conn:
            await conn.execute(_RELEASE, name, owner, epoch, self._schema)

    async def close(self) -> None:
        """Close the leases' own connection. Idempotent."""
        async with self._own_lock:
            conn, self._own = self._own, None
            if conn is not None:
                await _close(conn)

    async def wait(self, name: str, timeout: float) -> None:
        """Return when a release of ``name`` is notified, or after ``timeout``."""
        if self._notified.get(name, 0) != self._tried_at.get(name, 0):
            return  # released since the last try
        await self._released.wait(name, timeout)

    def on_released(self, payload: str) -> None:
        """The listener's callback for :data:`LEASE_CHANNEL`: wake the contenders of the
        lease named in ``payload`` if it is this store's schema's."""
        schema, _, name = payload.partition(":")
        if schema != self._schema:
            return  # another deployment sharing the database
        self._notified[name] = self._notified.get(name, 0) + 1
        self._released.wake(name)

    @asynccontextmanager
    async def _own_connection(self, what: str, name: str) -> AsyncIterator[Any]:
        """The leases' own connection, opened (again) when needed, for one statement at a
        time; one that failed is dropped, so the next call connects anew."""
        async with self._own_lock:
            try:
                if self._own is None or self._own.is_closed():
                    self._own = await self._db.connect(
                        "renew leases", server_settings={"search_path": self._schema}
                    )
                yield self._own
            except DRIVER_ERRORS as exc:
                conn, self._own = self._own, None
                if conn is not None:
                    await _close(conn)
                raise StoreError(
                    f"could not {what} {name!r} on PostgreSQL: {type(exc).__name__}: {exc}; "
                    "check that the server answers"
                ) from exc

    @asynccontextmanager
    async def _connection(self, what: str, name: str) -> AsyncIterator[Any]:
        try:
            async with self._db._pool().acquire() as conn:
                yield conn
        except DRIVER_ERRORS as exc:
            raise StoreError(
                f"could not {what} {name!r} on PostgreSQL: {type(exc).__name__}: {exc}; "
                "check that the server answers"
            ) from exc


async def _close(conn: Any) -> None:
    """Close ``conn``, dropping it when it cannot close cleanly (it is broken)."""
    try:
        await asyncio.wait_for(conn.close(), 1.0)
    except Exception:
        conn.terminate()
