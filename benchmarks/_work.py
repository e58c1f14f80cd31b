"""The per-message work of the network benchmarks' baselines, in one place.

``bench_nats.py`` and ``bench_kafka.py`` compare eventflow with a raw client (nats-py,
aiokafka) and with FastStream. A comparison is only honest if the baselines do, per
message, the work eventflow does for an idempotent typed handler:

1. decode the JSON envelope (orjson), take its ``id``, ``type`` and ``data``, check the
   type;
2. look the id up in the dedup store; a duplicate is acked and skipped;
3. validate ``data`` with the handler's pydantic model (the same ``Event`` class);
4. call the handler (empty here, but for counting);
5. record the id in the dedup store;
6. ack (NATS: an ``+ACK`` publish; Kafka: commit the finished offsets).

The raw baselines call ``Work.handle`` for steps 1 to 5 and ack themselves. FastStream does
steps 1 and 3 itself for a handler typed with ``Wire`` and acks after the handler returns;
its handler calls ``Work.seen`` and ``Work.record`` for steps 2 and 5.

The dedup store is a Python set (what eventflow's memory dedup store keeps), or, with
``--store postgresql://...``, ``PostgresDedup``: the statements eventflow's PostgreSQL dedup
store runs (a ``SELECT EXISTS`` before the handler, an ``INSERT ... ON CONFLICT DO NOTHING``
after it, each on a pooled connection, committing on its own), on a table of the same shape
in a schema made for the run and dropped after it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import asyncpg
import orjson
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_TABLE = """
CREATE TABLE dedup (
    grp text COLLATE "C" NOT NULL,
    message_id text COLLATE "C" NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (grp, message_id)
);
CREATE INDEX dedup_age ON dedup (handled_at);
"""


def fresh_schema(prefix: str) -> str:
    """A schema name no earlier run used (each run starts from empty tables)."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def with_schema(url: str, schema: str) -> str:
    """``url`` with eventflow's ``schema=`` store option added."""
    return f"{url}{'&' if urlsplit(url).query else '?'}schema={schema}"


def driver_dsn(url: str) -> str:
    """``url`` without its query (eventflow's own options are no libpq options)."""
    return url.split("?", 1)[0]


async def drop_schema(url: str, schema: str) -> None:
    """Drop a run's schema and everything in it."""
    conn = await asyncpg.connect(driver_dsn(url))
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def _keep_session(conn: Any) -> None:
    """Leave no transaction open when a connection goes back to the pool, and nothing more
    (asyncpg's default reset costs a round trip per release; eventflow's pool skips it)."""
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


async def settled(stats: Callable[[], Mapping[str, int]], n: int) -> Mapping[str, int]:
    """eventflow's consumer stats once all ``n`` handlings were counted (after the timing:
    a handler sees the last message before its dedup mark and its count; with PostgreSQL
    that mark is a round trip away). Waits at most 10 s."""
    deadline = asyncio.get_running_loop().time() + 10.0
    while stats()["handled"] + stats()["duplicates"] < n:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.01)
    return stats()


class PostgresDedup:
    """Handled (group, id) pairs in PostgreSQL, written as eventflow's dedup store does."""

    def __init__(self, url: str, group: str) -> None:
        self.url = url
        self.group = group
        self.schema = fresh_schema("bench_raw")
        self._pool: Any = None

    async def open(self) -> None:
        """Create the run's schema and table, and a pool whose search path is that schema."""
        conn = await asyncpg.connect(driver_dsn(self.url))
        try:
            await conn.execute(f'CREATE SCHEMA "{self.schema}"')
            await conn.execute(f'SET search_path TO "{self.schema}"')
            await conn.execute(_TABLE)
        finally:
            await conn.close()
        self._pool = await asyncpg.create_pool(
            driver_dsn(self.url),
            min_size=2,
            max_size=10,
            server_settings={"search_path": self.schema},
            reset=_keep_session,
        )

    async def close(self) -> None:
        """Close the pool and drop the run's schema."""
        if self._pool is not None:
            await self._pool.close()
        await drop_schema(self.url, self.schema)

    async def seen(self, message_id: str) -> bool:
        """True if the id was recorded."""
        async with self._pool.acquire() as conn:
            return bool(
                await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM dedup WHERE grp = $1 AND message_id = $2)",
                    self.group,
                    message_id,
                )
            )

    async def mark(self, message_id: str) -> None:
        """Record the id."""
        async with self._pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO dedup (grp, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                self.group,
                message_id,
            )


async def open_dedup(store: str | None, group: str) -> PostgresDedup | None:
    """The baselines' PostgreSQL dedup table for ``--store``, opened; None for a set."""
    if store is None:
        return None
    dedup = PostgresDedup(store, group)
    await dedup.open()
    return dedup


class Wire(BaseModel, Generic[M]):
    """The envelope fields a baseline reads, for FastStream's typed handlers
    (``Wire[BenchOrder]``: ``data`` is validated with the event model)."""

    id: str
    type: str
    data: M


class Work(Generic[M]):
    """One baseline consumer's per-message work (steps 1 to 5 of the module docstring).

    ``done`` is set once ``expected`` distinct messages were handled."""

    def __init__(
        self, model: type[M], event_type: str, expected: int, dedup: PostgresDedup | None = None
    ) -> None:
        self.model = model
        self.event_type = event_type
        self.expected = expected
        self.dedup = dedup
        self.ids: set[str] = set()
        self.handled = 0
        self.duplicates = 0
        self.done = asyncio.Event()

    async def handle(self, payload: bytes) -> None:
        """Decode, dedup check, validate, handle and record one message."""
        envelope = orjson.loads(payload)
        message_id: str = envelope["id"]
        if envelope["type"] != self.event_type:  # eventflow picks the validator by type
            raise ValueError(f"unexpected event type {envelope['type']!r}")
        if await self.seen(message_id):
            self.duplicates += 1
            return
        event = self.model.model_validate(envelope["data"])
        await self.handler(event)
        await self.record(message_id)

    async def handle_decoded(self, message_id: str, event: M) -> None:
        """Steps 2, 4 and 5 for a message FastStream already decoded and validated."""
        if await self.seen(message_id):
            self.duplicates += 1
            return
        await self.handler(event)
        await self.record(message_id)

    async def handler(self, event: M) -> None:
        """The user's handler: nothing to do (eventflow's benchmark handler only counts)."""

    async def seen(self, message_id: str) -> bool:
        """Step 2: was this id handled already?"""
        if self.dedup is not None:
            return await self.dedup.seen(message_id)
        return message_id in self.ids

    async def record(self, message_id: str) -> None:
        """Step 5: record the id as handled; count it."""
        if self.dedup is not None:
            await self.dedup.mark(message_id)
        else:
            self.ids.add(message_id)
        self.handled += 1
        if self.handled == self.expected:
            self.done.set()
