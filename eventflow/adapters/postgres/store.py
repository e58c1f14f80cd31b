"""The ``postgresql://`` store: the event log plus dedup, dead letters, heartbeats,
checkpoints, outbox and leases, on one asyncpg pool so they share transactions."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson

from ...errors import AlreadyHandled
from ...leases import Lease
from ...ports import DeadLetter, Heartbeat, Transaction
from .attempts import ATTEMPTS_SQL, PostgresAttempts
from .clock import PostgresClock
from .db import PostgresConfig, PostgresDatabase, PostgresTransaction
from .dedup import DEDUP_KEY, DEDUP_SQL, INSERT_DEDUP, RIDE_DEDUP, PostgresDedupStore
from .events import PostgresEventLog
from .leases import FENCE, LEASE_CHANNEL, PostgresLeases, fence_args, writing
from .outbox import PostgresOutbox
from .rider import Rider
from .schema import SCHEMA_SQL

if TYPE_CHECKING:
    from ...supervision import Supervisor

__all__ = ["PostgresStore"]

# Writes made under a lease: one statement each, whose FENCE query locks the lease's row
# (FOR SHARE) until the statement's transaction ends, the caller's or its own. They return
# a row only if the lease still holds.
_SET_FENCED = (
    f"WITH {FENCE} INSERT INTO ef_checkpoints (name, position) "
    "SELECT $4::text, $5::bigint FROM fence "
    "ON CONFLICT (name) DO UPDATE SET position = excluded.position RETURNING 1"
)
_DELETE_FENCED = (
    f"WITH {FENCE}, gone AS (DELETE FROM ef_checkpoints WHERE name = $4 "
    "AND EXISTS (SELECT 1 FROM fence)) SELECT 1 FROM fence"
)


class PostgresDeadLetterStore:
    """Dead letters in ``ef_dead_letters``, oldest first."""

    _COLS = (
        "id, topic, grp, payload, error, reason, attempts, failed_at, msg_key, "
        "headers::text, envelope_id, source::text"
    )

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def add(self, d: DeadLetter) -> None:
        """Insert ``d``."""
        async with self._db.connection() as conn:
            await conn.execute(
                "INSERT INTO ef_dead_letters (id, topic, grp, payload, error, reason, attempts, "
                "failed_at, msg_key, headers, envelope_id, source) VALUES "
                "($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11, $12::jsonb) "
                "ON CONFLICT (id) DO NOTHING",
                d.id,
                d.topic,
                d.group,
                d.payload,
                d.error,
                d.reason,
                d.attempts,
                d.failed_at,
                d.key,
                orjson.dumps(dict(d.headers)).decode(),
                d.envelope_id,
                orjson.dumps(dict(d.source)).decode(),
            )

    @staticmethod
    def _letter(r: Any) -> DeadLetter:
        return DeadLetter(
            id=r[0],
            topic=r[1],
            group=r[2],
            payload=bytes(r[3]),
            error=r[4],
            reason=r[5],
            attempts=r[6],
            failed_at=r[7],
            key=r[8],
            headers=orjson.loads(r[9]),
            envelope_id=r[10],
            source=orjson.loads(r[11]),
        )

    async def list(self, *, group: str | None = None, limit: int = 100) -> list[DeadLetter]:
        """Oldest first, optionally one group's."""
        async with self._db.connection() as conn:
            rows = await conn.fetch(
                f"SELECT {self._COLS} FROM ef_dead_letters "
                "WHERE ($1::text IS NULL OR grp = $1) ORDER BY seq LIMIT $2",
                group,
                limit,
            )
        return [self._letter(r) for r in rows]

    async def get(self, letter_id: str) -> DeadLetter | None:
        """One letter or None."""
        async with self._db.connection() as conn:
            row = await conn.fetchrow(
                f"SELECT {self._COLS} FROM ef_dead_letters WHERE id = $1", letter_id
            )
        return None if row is None else self._letter(row)

    async def remove(self, letter_ids: Sequence[str]) -> int:
        """Delete; return how many existed."""
        async with self._db.connection() as conn:
            status = await conn.execute(
                "DELETE FROM ef_dead_letters WHERE id = ANY($1::text[])", list(letter_ids)
            )
        return int(status.split()[-1])

    async def count(self) -> dict[str, int]:
        """Letters per group."""
        async with self._db.connection() as conn:
            rows = await conn.fetch("SELECT grp, COUNT(*) FROM ef_dead_letters GROUP BY grp")
        return {r[0]: int(r[1]) for r in rows}


class PostgresHeartbeats:
    """Heartbeats in ``ef_heartbeats``."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def beat(self, hb: Heartbeat) -> None:
        """Insert or replace the instance's row."""
        async with self._db.connection() as conn:
            await conn.execute(
                "INSERT INTO ef_heartbeats (instance, app, host, pid, started_at, last_seen, "
                "subscriptions, stats, health, problems) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8::jsonb, $9, $10::jsonb) "
                "ON CONFLICT (instance) DO UPDATE SET last_seen = excluded.last_seen, "
                "subscriptions = excluded.subscriptions, stats = excluded.stats, "
                "health = excluded.health, problems = excluded.problems",
                hb.instance,
                hb.app,
                hb.host,
                hb.pid,
                hb.started_at,
                hb.last_seen,
                orjson.dumps(list(hb.subscriptions)).decode(),
                orjson.dumps(dict(hb.stats)).decode(),
                hb.health,
                orjson.dumps(list(hb.problems)).decode(),
            )

    async def list(self) -> list[Heartbeat]:
        """Newest first."""
        async with self._db.connection() as conn:
            rows = await conn.fetch(
                "SELECT instance, app, host, pid, started_at, last_seen, subscriptions::text, "
                "stats::text, health, problems::text FROM ef_heartbeats "
                "ORDER BY last_seen DESC"
            )
        return [
            Heartbeat(
                instance=r[0],
                app=r[1],
                host=r[2],
                pid=r[3],
                started_at=r[4],
                last_seen=r[5],
                subscriptions=tuple(orjson.loads(r[6])),
                stats=orjson.loads(r[7]),
                health=r[8],
                problems=tuple(orjson.loads(r[9])),
            )
            for r in rows
        ]

    async def remove(self, instance: str) -> None:
        """Delete the instance's row."""
        async with self._db.connection() as conn:
            await conn.execute("DELETE FROM ef_heartbeats WHERE instance = $1", instance)

    async def prune(self, older_than: float) -> int:
        """Delete rows not refreshed for ``older_than`` seconds."""
        async with self._db.connection() as conn:
            status = await conn.execute(
                "DELETE FROM ef_heartbeats WHERE last_seen < $1",
                datetime.now(UTC) - timedelta(seconds=older_than),
            )
        return int(status.split()[-1])


class PostgresCheckpoints:
    """Checkpoints in ``ef_checkpoints``; writes made with a lease are fenced."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def get(self, name: str) -> int:
        """0 if never set."""
        async with self._db.connection() as conn:
            value = await conn.fetchval("SELECT position FROM ef_checkpoints WHERE name = $1", name)
        return int(value or 0)

    async def set(
        self,
        name: str,
        position: int,
        *,
        tx: Transaction | None = None,
        lease: Lease | None = None,
    ) -> None:
        """Upsert (inside the context's open transaction, if any); with ``lease``, in the
        same statement as the check of its epoch, else ``LeaseLostError``."""
        async with writing(self._db, f"set checkpoint {name!r}", tx) as conn:
            if lease is None:
                await conn.execute(
                    "INSERT INTO ef_checkpoints (name, position) VALUES ($1, $2) "
                    "ON CONFLICT (name) DO UPDATE SET position = excluded.position",
                    name,
                    position,
                )
            elif await conn.fetchval(_SET_FENCED, *fence_args(lease), name, position) is None:
                raise lease.error()

    async def list(self) -> dict[str, int]:
        """Every checkpoint."""
        async with self._db.connection() as conn:
            rows = await conn.fetch("SELECT name, position FROM ef_checkpoints ORDER BY name")
        return {r[0]: int(r[1]) for r in rows}

    async def delete(
        self, name: str, *, tx: Transaction | None = None, lease: Lease | None = None
    ) -> None:
        """Forget ``name``; fenced like ``set``."""
        async with writing(self._db, f"delete checkpoint {name!r}", tx) as conn:
            if lease is None:
                await conn.execute("DELETE FROM ef_checkpoints WHERE name = $1", name)
            elif await conn.fetchval(_DELETE_FENCED, *fence_args(lease), name) is None:
                raise lease.error()


class PostgresStore(PostgresEventLog):
    """The PostgreSQL store. ``postgresql://user@host/db?schema=NAME``."""

    durable = True
    """Every process connecting to the database sees the same data."""
    supports_sql = True
    """Its transactions run SQL."""

    def __init__(self, config: PostgresConfig, *, url: str | None = None) -> None:
        self.config = config
        self.url = url or config.dsn
        self.db = PostgresDatabase(config)
        self.dedup = PostgresDedupStore(self.db)
        self.dead_letters = PostgresDeadLetterStore(self.db)
        self.heartbeats = PostgresHeartbeats(self.db)
        self.checkpoints = PostgresCheckpoints(self.db)
        self.outbox = PostgresOutbox(self.db)
        self.attempts = PostgresAttempts(self.db)
        self.leases = PostgresLeases(self.db)
        self.clock = PostgresClock(self.db)
        self._init_events(
            {LEASE_CHANNEL: self.leases.on_released, self.outbox.channel: self.outbox.heard},
            reconnected=[self.outbox.heard],
        )
        self._opened = False

    @classmethod
    def from_url(cls, url: str) -> PostgresStore:
        """Build an unopened store from a ``postgresql://`` URL."""
        return cls(PostgresConfig.from_url(url), url=url)

    async def open(self, supervisor: Supervisor | None = None) -> None:
        """Connect, create the schema if needed and start the sequencer. Idempotent."""
        if self._opened:
            return
        await self.db.open(SCHEMA_SQL + DEDUP_SQL + ATTEMPTS_SQL)
        try:
            await self._start_events(supervisor)
        except BaseException:
            await self.db.close()
            raise
        self._opened = True

    async def close(self) -> None:
        """Stop the sequencer and close the pool. Idempotent."""
        if not self._opened:
            return
        self._opened = False
        try:
            await self._stop_events()
            await self.leases.close()
        finally:
            await self.db.close()

    async def __aenter__(self) -> PostgresStore:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def transaction(self) -> AbstractAsyncContextManager[PostgresTransaction]:
        """A transaction every store call of this context joins until the block exits."""
        return self.db.transaction()

    async def mark_handled(
        self, group: str, message_id: str, tx: Transaction, *, cancelled_by: str | None = None
    ) -> None:
        """Record a dedup entry inside ``tx``; raise ``AlreadyHandled`` if a copy committed
        one first (a concurrent copy's insert waits for the first transaction, then finds its
        row). Nothing more when a rider (:meth:`handled_rider`) wrote it in ``tx``."""
        if cancelled_by is None and self.db.marked(tx, group, message_id):
            return
        async with self.db.connection(tx) as conn:
            inserted = await conn.fetchval(INSERT_DEDUP, group, message_id, cancelled_by)
        if inserted is None:
            raise AlreadyHandled(group, message_id)

    def handled_rider(self, group: str, message_id: str) -> Rider:
        """:meth:`mark_handled` as a rider of an append (:mod:`.rider`), in the context's
        open transaction: the entry goes in with the append's statement, or a copy's entry
        committed first fails that statement whole with ``AlreadyHandled`` (roll back).
        Once the append returned, :meth:`mark_handled` of the pair in the transaction
        writes nothing more."""
        db = self.db
        return Rider(
            RIDE_DEDUP,
            (group, message_id),
            written=lambda: db.note_marked(group, message_id),
            conflict=(DEDUP_KEY, lambda: AlreadyHandled(group, message_id)),
        )
