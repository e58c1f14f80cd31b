"""The SQL backend of cluster limits reserves a rate token from the moment it got the
limit's row lock, not from when its statement began waiting for it: an acquire that waited
behind another transaction would otherwise reserve a moment in the past and begin at once,
bunched with the entries after it (more than ``rate`` in a second, as measured by the
callers, on a busy PostgreSQL)."""

from __future__ import annotations

import asyncio

from eventflow import Limit, open_store
from eventflow.limits.sql import SqlLimitBackend
from eventflow.testing.postgres import isolated_schema, postgres_url


async def test_a_token_is_reserved_from_when_the_row_lock_was_got() -> None:
    limit = Limit("api", rate=10.0, scope="cluster")  # one token every 0.1 s
    async with isolated_schema(postgres_url()) as url, open_store(url) as store:
        backend = SqlLimitBackend.for_store(store, "api")
        await backend.open()
        assert (await backend.acquire(limit, "s1", 10.0)).ok  # the row exists now
        await asyncio.sleep(0.2)  # the bucket refills: the next token is free at once
        held, release = asyncio.Event(), asyncio.Event()

        async def hold_the_row() -> None:
            async with store.transaction() as tx:
                await tx.fetch("SELECT tat FROM ef_limits WHERE name = $1 FOR UPDATE", "api")
                held.set()
                await release.wait()

        holder = asyncio.create_task(hold_the_row())
        await held.wait()
        waiting = asyncio.create_task(backend.acquire(limit, "s2", 10.0))
        await asyncio.sleep(0.5)  # the acquire's statement waits for the row meanwhile
        assert not waiting.done()  # a positive control: it is blocked behind the holder
        released_at = await store.clock.now()
        release.set()
        await holder
        got = await waiting
        async with store.transaction() as tx:
            rows = await tx.fetch("SELECT tat FROM ef_limits WHERE name = $1", "api")
    assert got.ok and got.wait == 0.0  # the bucket had refilled while it waited
    # Its token is reserved at the time it got the row (after released_at), so the next
    # free moment is one emission after that, not 0.4 s in the past (which would let the
    # next entry, right after it, begin at once too: two in one emission).
    assert float(rows[0][0]) >= released_at + limit.emission
