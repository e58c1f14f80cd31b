"""The PostgreSQL store's outbox, and how its relay hears adds made by other processes.

An add is one statement: it inserts the rows and calls ``pg_notify`` on the outbox's
channel, which PostgreSQL delivers when the add's transaction commits, and only then (a
rollback sends nothing). Every process on the store listens on that channel on the store's
listener connection (:mod:`.sequencer`) and sets ``added`` when it hears it, so the relay,
whichever instance holds its lease, sends the rows at once. After the listener lost its
connection and made a new one, it sets ``added`` too: what was notified meanwhile is lost.
While this store object's own relay holds the lease (``relaying``), adds notify no one: the
relay that sends them is woken in-process.

The channel is named for the store's schema (:func:`outbox_channel`): channels are
database-wide, and the relay of another schema on the database must neither hear this
one's adds nor mistake them for its own. The costs, per transaction that added rows:

- one notification, whatever the number of adds and rows in it (PostgreSQL sends the
  identical notifications of one transaction once), carried by the add's own statement,
  so no round trip is added;
- at commit, a transaction that notified takes a lock that every notifying commit of the
  server takes, and holds it while its commit is flushed: such commits are flushed one
  after the other, not together. Writers of one-row transactions on a 2-core test
  machine ran at 85% (one writer) and 66-73% (8 concurrent writers) of the throughput of
  silent ones (``benchmarks/bench_outbox_wakeups.py notify``); end to end, with 8
  concurrent handlers on NATS, notifying from the holder's own process cost about 6-8%,
  hence ``relaying``;
- the notification waits in the server's notification queue (8 GB by default) until every
  session listening in the database has read it; a listener that stops reading (a process
  whose event loop is stuck, with its connection open) holds the queue, and once it is
  full, notifying commits fail. Sessions of every schema of the database are woken to
  read it (only this schema's listeners receive it).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from ...envelope import Envelope
from ...leases import Lease
from ...ports import OutboxMessage, Transaction
from .db import PostgresDatabase
from .leases import FENCE, fence_args, writing
from .rider import APPENDED, Rider

__all__ = ["PostgresOutbox", "outbox_channel"]

_MAX_CHANNEL = 63  # bytes in a PostgreSQL identifier (NAMEDATALEN - 1)


def outbox_channel(schema: str) -> str:
    """The notification channel of the outbox of the store in ``schema``: one per schema,
    since channels are database-wide (another schema's relay hears nothing of this one's
    adds). A name past PostgreSQL's 63 bytes would be cut short by ``LISTEN`` (and refused
    by ``pg_notify``), so a long schema name is hashed instead, after a ``#`` no schema
    name has, so the two forms never meet."""
    channel = f"ef_outbox_{schema}"
    if len(channel.encode()) <= _MAX_CHANNEL:
        return channel
    return "ef_outbox#" + hashlib.sha256(schema.encode()).hexdigest()[:40]


# One statement: the rows, in order. With a notification of the outbox's channel ($5),
# which PostgreSQL delivers when the transaction commits, once per transaction however
# many adds it made (identical notifications of one transaction are sent once).
_INSERT = (
    "INSERT INTO ef_outbox (topic, msg_key, payload, message_id) "
    "SELECT t, k, p, m FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[]) "
    "WITH ORDINALITY AS u(t, k, p, m, o) ORDER BY o"
)
_INSERT_NOTIFY = (
    f"WITH added AS ({_INSERT} RETURNING 1) "
    "SELECT pg_notify($5, '') FROM (SELECT 1 FROM added LIMIT 1) AS any_added"
)
# The same as a rider of an append (rider.py): the notification is sent from RETURNING
# (once per transaction, however many rows), since a rider's output is not read.
_RIDE = (
    "INSERT INTO ef_outbox (topic, msg_key, payload, message_id) "
    "SELECT t, k, p, m FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[]) "
    f"WITH ORDINALITY AS u(t, k, p, m, o) WHERE {APPENDED} ORDER BY o"
)
_RIDE_NOTIFY = f"{_RIDE} RETURNING pg_notify($5, '')"
_REMOVE_FENCED = (
    f"WITH {FENCE}, gone AS (DELETE FROM ef_outbox WHERE seq = ANY($4::bigint[]) "
    "AND EXISTS (SELECT 1 FROM fence)) SELECT 1 FROM fence"
)


class PostgresOutbox:
    """Outgoing messages in ``ef_outbox``. An add notifies :attr:`channel` at its commit;
    the store's listener connection hears it in every process on the schema and sets
    ``added`` there, so the relay, wherever it runs, sends the messages at once."""

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db
        self.added = asyncio.Event()
        self.channel = outbox_channel(db.config.schema)
        self._relaying = 0

    @asynccontextmanager
    async def relaying(self) -> AsyncIterator[None]:
        """While the relay of this store object holds the relay lease, adds notify no one:
        ``added`` wakes it (see ``Outbox.relaying``)."""
        self._relaying += 1
        try:
            yield
        finally:
            self._relaying -= 1

    async def add(
        self, messages: Sequence[tuple[str, Envelope]], *, tx: Transaction | None = None
    ) -> None:
        """Queue messages (inside ``tx``, or the context's open transaction, if any); their
        commit notifies :attr:`channel`, unless this store object's relay holds the lease."""
        if not messages:
            return
        columns = _columns(messages)
        async with self._db.connection(tx) as conn:
            if self._relaying:
                await conn.execute(_INSERT, *columns)
            else:
                await conn.execute(_INSERT_NOTIFY, *columns, self.channel)
        self._db.after_commit(self.added.set, tx)

    def rider(self, messages: Sequence[tuple[str, Envelope]]) -> Rider:
        """The rows :meth:`add` would write, as a rider of an append (:mod:`.rider`):
        written by the append's statement, in its transaction, if the append succeeds."""
        columns = _columns(messages)
        if self._relaying:
            return Rider(_RIDE, columns, self.added.set)
        return Rider(_RIDE_NOTIFY, (*columns, self.channel), self.added.set)

    def heard(self, _payload: str | None = None) -> None:
        """The listener's callback for :attr:`channel` (an add committed, in any process),
        also called after the listener reconnected (an add may have been missed): wake the
        relay."""
        self.added.set()

    async def pending(self, limit: int = 100) -> list[OutboxMessage]:
        """Oldest first."""
        async with self._db.connection() as conn:
            rows = await conn.fetch(
                "SELECT seq, topic, msg_key, payload, message_id FROM ef_outbox "
                "ORDER BY seq LIMIT $1",
                limit,
            )
        return [OutboxMessage(r[0], r[1], r[2], bytes(r[3]), r[4]) for r in rows]

    async def backlog(self, limit: int = 1000) -> tuple[int, OutboxMessage | None]:
        """One connection, two reads."""
        async with self._db.connection() as conn:
            counted = await conn.fetchval(
                "SELECT count(*) FROM (SELECT 1 FROM ef_outbox LIMIT $1) AS o", limit
            )
            row = await conn.fetchrow(
                "SELECT seq, topic, msg_key, payload, message_id FROM ef_outbox "
                "ORDER BY seq LIMIT 1"
            )
        if row is None:
            return int(counted), None
        return int(counted), OutboxMessage(row[0], row[1], row[2], bytes(row[3]), row[4])

    async def remove(self, seqs: Sequence[int], *, lease: Lease | None = None) -> None:
        """Delete sent messages; with ``lease`` (the relay's), fenced like checkpoints."""
        async with writing(self._db, "remove sent outbox messages") as conn:
            if lease is None:
                await conn.execute(
                    "DELETE FROM ef_outbox WHERE seq = ANY($1::bigint[])", list(seqs)
                )
            elif await conn.fetchval(_REMOVE_FENCED, *fence_args(lease), list(seqs)) is None:
                raise lease.error()


def _columns(
    messages: Sequence[tuple[str, Envelope]],
) -> tuple[list[str], list[str | None], list[bytes], list[str]]:
    """The outbox rows' columns (topic, key, payload, message id), one list each."""
    columns: tuple[list[str], list[str | None], list[bytes], list[str]] = ([], [], [], [])
    for topic, env in messages:
        columns[0].append(topic)
        columns[1].append(env.key)
        columns[2].append(env.to_bytes())
        columns[3].append(env.id)
    return columns
