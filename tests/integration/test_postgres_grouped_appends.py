"""Grouped appends on PostgreSQL: concurrent appends made outside a transaction at a known
version are written together, several streams in one statement, and each caller still gets
its own result or its own ``ConcurrencyError``.

``store.append_groups`` counts what happened (``groups``: statements that wrote a group;
``combined``: appends that went in as part of a group of two or more; ``fell_back``: appends
a group sent back to the one-stream path), so each test can show that it exercised a group.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from eventflow import ConcurrencyError, Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres.grouped import MAX_WRITERS, WRITERS
from eventflow.events import envelope_for
from eventflow.testing.postgres import isolated_schema, postgres_url

pytestmark = pytest.mark.service("postgres")

N = 24


class Grouped(Event, type="it.grouped.item"):
    """One append's event."""

    n: int


async def _stored(store: PostgresStore, stream: str) -> list[int]:
    return [rec.event.n async for rec in store.read_stream(stream)]  # type: ignore[attr-defined]


async def _hold(store: PostgresStore, streams: list[str]) -> tuple[asyncpg.Connection, Any]:
    """A connection of its own whose open transaction wrote version 1 of each of ``streams``
    (uncommitted: an append to one of them waits for its row); roll back to let them go."""
    holder = await asyncpg.connect(store.config.dsn)
    try:
        await holder.execute(f'SET search_path TO "{store.config.schema}"')
        tx = holder.transaction()
        await tx.start()
        for stream in streams:
            await holder.execute(
                "INSERT INTO ef_events (event_id, stream_id, stream_version, envelope) "
                "VALUES ($1, $1, 1, '\\x7b7d'::bytea)",
                stream,
            )
    except BaseException:
        await holder.close()
        raise
    return holder, tx


async def test_concurrent_appends_to_different_streams_are_combined(
    postgres_store: PostgresStore,
) -> None:
    stats = postgres_store.append_groups
    versions = await asyncio.gather(
        *(postgres_store.append(f"s-{n}", [Grouped(n=n)], expected_version=0) for n in range(N))
    )
    assert versions == [1] * N
    # At most WRITERS appends found a writer free and went alone; the others waited and
    # were written together.
    assert stats.combined >= N - 2 * WRITERS
    assert stats.groups < N
    for n in range(N):
        assert await _stored(postgres_store, f"s-{n}") == [n]
    # Multi-event appends at a version > 0, combined too, each stream in version order.
    batches = await asyncio.gather(
        *(
            postgres_store.append(
                f"s-{n}", [Grouped(n=10 * n + k) for k in range(3)], expected_version=1
            )
            for n in range(N)
        )
    )
    assert batches == [4] * N
    for n in range(N):
        assert await _stored(postgres_store, f"s-{n}") == [n] + [10 * n + k for k in range(3)]
        versions_positions = [
            (r.stream_version, r.position) async for r in postgres_store.read_stream(f"s-{n}")
        ]
        assert [v for v, _ in versions_positions] == [1, 2, 3, 4]
        assert [p for _, p in versions_positions] == sorted(p for _, p in versions_positions)
    positions = [r.position async for r in postgres_store.read_all()]
    assert positions == list(range(1, 4 * N + 1))


async def test_one_event_groups_and_mixed_groups_keep_each_streams_order(
    postgres_store: PostgresStore,
) -> None:
    # Groups of one-event appends go in one plain INSERT, any other group through the join:
    # a group mixing both, then one-event appends at a version > 0 after it.
    sizes = [1 + n % 3 for n in range(N)]
    first = await asyncio.gather(
        *(
            postgres_store.append(
                f"m-{n}", [Grouped(n=k) for k in range(sizes[n])], expected_version=0
            )
            for n in range(N)
        )
    )
    assert first == sizes
    after = await asyncio.gather(
        *(
            postgres_store.append(f"m-{n}", [Grouped(n=100)], expected_version=sizes[n])
            for n in range(N)
        )
    )
    assert after == [s + 1 for s in sizes]
    assert postgres_store.append_groups.combined >= 2 * N - 4 * WRITERS
    for n in range(N):
        assert await _stored(postgres_store, f"m-{n}") == [*range(sizes[n]), 100]
    positions = [r.position async for r in postgres_store.read_all()]
    assert positions == list(range(1, sum(sizes) + N + 1))


async def test_a_conflict_in_one_stream_fails_only_its_caller(
    postgres_store: PostgresStore,
) -> None:
    stats = postgres_store.append_groups
    await postgres_store.append("taken", [Grouped(n=0)], expected_version=0)
    await postgres_store.append("moved", [Grouped(n=0), Grouped(n=1)], expected_version=0)

    async def one(n: int) -> int | ConcurrencyError:
        stream, expected = {7: ("taken", 0), 13: ("moved", 1)}.get(n, (f"f-{n}", 0))
        try:
            return await postgres_store.append(stream, [Grouped(n=n)], expected_version=expected)
        except ConcurrencyError as exc:
            return exc

    results = await asyncio.gather(*(one(n) for n in range(N)))
    taken, moved = results[7], results[13]
    assert isinstance(taken, ConcurrencyError) and isinstance(moved, ConcurrencyError)
    assert (taken.stream, taken.expected, taken.actual) == ("taken", 0, 1)
    assert (moved.stream, moved.expected, moved.actual) == ("moved", 1, 2)
    assert [r for n, r in enumerate(results) if n not in (7, 13)] == [1] * (N - 2)
    assert stats.fell_back >= 2  # both were in a group, and sent back to their own path
    assert stats.combined >= N - 2 - 2 * WRITERS
    assert await _stored(postgres_store, "taken") == [0]
    assert await _stored(postgres_store, "moved") == [0, 1]
    # Two concurrent appends to one stream at the same version: one wins, one conflicts.
    racing = await asyncio.gather(
        *(postgres_store.append("race", [Grouped(n=n)], expected_version=0) for n in range(4)),
        return_exceptions=True,
    )
    assert sorted(str(type(r).__name__) for r in racing) == ["ConcurrencyError"] * 3 + ["int"]
    assert len(await _stored(postgres_store, "race")) == 1


async def test_ids_already_stored_are_skipped_in_a_group(postgres_store: PostgresStore) -> None:
    stats = postgres_store.append_groups
    first = [envelope_for(Grouped(n=n), source="test") for n in range(N)]
    assert (
        await asyncio.gather(
            *(postgres_store.append(f"d-{n}", [first[n]], expected_version=0) for n in range(N))
        )
        == [1] * N
    )
    before = stats.combined
    # The same envelopes again with the original expected version (a retried command), in a
    # group with fresh appends: a no-op returning the stream's version, the others go in.
    again = await asyncio.gather(
        *(
            postgres_store.append(f"d-{n}", [first[n]], expected_version=0)
            if n % 2
            else postgres_store.append(f"e-{n}", [Grouped(n=n)], expected_version=0)
            for n in range(N)
        )
    )
    assert again == [1] * N
    assert stats.combined > before
    for n in range(N):
        assert await _stored(postgres_store, f"d-{n}") == [n]
    # An id stored in another stream, beside fresh appends in one group: the fresh ones go
    # in, the stored one is skipped (the one-stream path decides), nothing is duplicated.
    mixed = await asyncio.gather(
        *(
            postgres_store.append("elsewhere", [first[0]], expected_version=0)
            if n == 5
            else postgres_store.append(f"g-{n}", [Grouped(n=n)], expected_version=0)
            for n in range(N)
        )
    )
    assert mixed == [0 if n == 5 else 1 for n in range(N)]
    assert await _stored(postgres_store, "elsewhere") == []
    async with postgres_store.db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM ef_events") == N + N // 2 + N - 1
    # One envelope appended to two streams at once: it is stored once.
    shared = envelope_for(Grouped(n=99), source="test")
    both = await asyncio.gather(
        *(postgres_store.append(f"h-{n}", [shared], expected_version=0) for n in range(2)),
        *(postgres_store.append(f"i-{n}", [Grouped(n=n)], expected_version=0) for n in range(8)),
    )
    assert sorted(both[:2]) == [0, 1] and both[2:] == [1] * 8
    assert sorted([len(await _stored(postgres_store, f"h-{n}")) for n in range(2)]) == [0, 1]


async def test_a_lone_append_and_appends_in_a_transaction_are_not_grouped(
    postgres_store: PostgresStore,
) -> None:
    stats = postgres_store.append_groups
    assert await postgres_store.append("alone", [Grouped(n=1)], expected_version=0) == 1
    with pytest.raises(ConcurrencyError) as conflict:
        await postgres_store.append("alone", [Grouped(n=2)], expected_version=0)
    assert (conflict.value.expected, conflict.value.actual) == (0, 1)
    assert (stats.groups, stats.combined) == (0, 0)  # nothing waited: no group was formed
    # Inside a caller's transaction appends are never grouped: they commit with it.
    with pytest.raises(RuntimeError):
        async with postgres_store.transaction():
            await asyncio.gather(
                *(
                    postgres_store.append(f"tx-{n}", [Grouped(n=n)], expected_version=0)
                    for n in range(8)
                )
            )
            raise RuntimeError("roll back")
    assert (stats.groups, stats.combined) == (0, 0)
    for n in range(8):
        assert await _stored(postgres_store, f"tx-{n}") == []


async def test_a_waiting_caller_that_is_cancelled_appends_nothing(
    postgres_store: PostgresStore,
) -> None:
    """Every writer is held up (its statement waits for another transaction's row; each one
    held up lends its slot to the next, up to MAX_WRITERS), so new appends wait in the queue;
    one cancelled there leaves nothing behind, and the one after it is written (a group of
    one) once a writer is free."""
    stats = postgres_store.append_groups
    # The holder writes version 1 of each "held-k" and keeps its transaction open.
    holder, tx = await _hold(postgres_store, [f"held-{k}" for k in range(MAX_WRITERS)])
    try:
        blocked = []
        for k in range(MAX_WRITERS):
            # Each finds a writer free, and waits on the unique index for the holder.
            blocked.append(
                asyncio.create_task(
                    postgres_store.append(f"held-{k}", [Grouped(n=k)], expected_version=0)
                )
            )
            await asyncio.sleep(0.2)
        waiting = asyncio.create_task(
            postgres_store.append("cancelled", [Grouped(n=-1)], expected_version=0)
        )
        after = asyncio.create_task(
            postgres_store.append("after", [Grouped(n=1)], expected_version=0)
        )
        await asyncio.sleep(0.2)
        assert stats.waiting == 2 and not waiting.done() and not after.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert stats.waiting == 1
        await tx.rollback()  # the writers go on
        assert await asyncio.wait_for(after, 10) == 1
        assert [await asyncio.wait_for(t, 10) for t in blocked] == [1] * MAX_WRITERS
    finally:
        await holder.close()
    # The held appends after the first waited for a slot (each a group of one), and so
    # did 'after'; nothing was combined.
    assert (stats.groups, stats.combined) == (MAX_WRITERS, 0)
    assert await _stored(postgres_store, "cancelled") == []
    assert await _stored(postgres_store, "after") == [1]


async def test_a_stream_held_by_a_transaction_holds_up_no_other_stream(
    postgres_store: PostgresStore,
) -> None:
    """An append waiting for another transaction's row (the stream's next version, written
    and not committed) has the store's one writer slot; once it has waited for longer than
    the stall time, appends to other streams go on without it, grouped as before."""
    stats = postgres_store.append_groups
    holder, tx = await _hold(postgres_store, ["held"])
    try:
        blocked = asyncio.create_task(
            postgres_store.append("held", [Grouped(n=0)], expected_version=0)
        )
        await asyncio.sleep(0.1)
        assert not blocked.done()
        others = await asyncio.wait_for(
            asyncio.gather(
                *(
                    postgres_store.append(f"o-{n}", [Grouped(n=n)], expected_version=0)
                    for n in range(N)
                )
            ),
            5,
        )
        assert others == [1] * N and not blocked.done()
        assert stats.combined >= N - 2 * WRITERS
        await tx.rollback()
        assert await asyncio.wait_for(blocked, 10) == 1
    finally:
        await holder.close()
    assert await _stored(postgres_store, "held") == [0]


async def test_once_a_stall_ends_the_store_goes_back_to_one_writer(
    postgres_store: PostgresStore,
) -> None:
    """Eight callers append in a loop while one stream is held (its append stalls and lends
    its slot out: a second writer runs), and go on once it is released: from then on the
    writer that is not needed stops, and each statement writes one append of every caller
    (with two writers left running, one wrote a group and the other one append at a time)."""
    stats = postgres_store.append_groups
    holder, tx = await _hold(postgres_store, ["held"])
    blocked = asyncio.create_task(postgres_store.append("held", [Grouped(n=0)], expected_version=0))
    await asyncio.sleep(0.1)
    window: dict[str, int] = {}
    appended = 0
    # The others go on until caller 0 is done: they get ahead while it ends the stall (the
    # faster the appends, the further), and must still be appending in its window.
    finished = asyncio.Event()

    async def caller(w: int) -> None:
        nonlocal appended
        i = -1
        while (w == 0 and i < 59) or (w != 0 and not finished.is_set()):
            i += 1
            if w == 0 and i == 20:
                await tx.rollback()
                await holder.close()
                assert await asyncio.wait_for(blocked, 10) == 1
            if w == 0 and i in (40, 59):
                window[f"groups{i}"], window[f"appended{i}"] = stats.groups, appended
            await postgres_store.append(f"c-{w}-{i}", [Grouped(n=i)], expected_version=0)
            appended += 1
        if w == 0:
            finished.set()

    try:
        await asyncio.wait_for(asyncio.gather(*(caller(w) for w in range(8))), 60)
    finally:
        if not holder.is_closed():
            await holder.close()
    statements = window["groups59"] - window["groups40"]
    appends = window["appended59"] - window["appended40"]
    assert appends >= 8 * 15
    assert statements <= appends / 8 * 1.5, (statements, appends)


async def test_a_writer_keeps_no_connection_the_pool_cannot_spare() -> None:
    # The writer keeps its connection from group to group only while the pool has another
    # to give: with a pool of one, a reader still gets it between groups (kept for the
    # whole run, it waited until the appends stopped).
    async with isolated_schema(postgres_url()) as url:
        store = PostgresStore.from_url(f"{url}&pool=1")
        await store.open()
        try:
            done = asyncio.Event()
            reads: list[float] = []

            async def writer(w: int) -> None:
                for i in range(600):
                    await store.append(f"p-{w}-{i}", [Grouped(n=i)], expected_version=0)

            async def reader() -> None:
                loop = asyncio.get_running_loop()
                while not done.is_set():
                    started = loop.time()
                    await store.last_position()
                    reads.append(loop.time() - started)
                    await asyncio.sleep(0.005)

            reading = asyncio.create_task(reader())
            started = asyncio.get_running_loop().time()
            await asyncio.gather(*(writer(w) for w in range(8)))
            took = asyncio.get_running_loop().time() - started
            done.set()
            await reading
            assert store.append_groups.combined > 0
            assert len(reads) >= 3, (took, reads)
            assert max(reads[:-1] or [0.0]) < max(0.5, took / 2), (took, reads)
        finally:
            await store.close()
