"""The SQLite store's reads in the event loop (``reader.py``): the dedup check and the
relay's look at a small outbox need no trip to the database thread, see what is committed
(by this store or another on the file), and go to the thread when they cannot read at once
or the outbox holds large payloads."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from eventflow import Event
from eventflow.adapters.sqlite import SqliteStore
from eventflow.adapters.sqlite.outbox import INLINE_BYTES
from eventflow.adapters.sqlite.reader import Reader
from eventflow.events import to_envelope


class Note(Event, type="it.sqlite.reader.note"):
    text: str


async def test_the_dedup_check_and_a_small_look_answer_while_the_thread_is_busy(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "r.db")
    async with SqliteStore(path) as store, SqliteStore(path) as other:
        await other.dedup.mark("g", "m1")  # another store on the file: not in the cache
        await store.outbox.add([("t", to_envelope(Note(text="a"), source="t"))])
        release = threading.Event()
        blocked = store.db._worker.submit(release.wait, 10)  # type: ignore[union-attr]
        try:
            # Neither waits for the thread: both read in the event loop.
            assert await asyncio.wait_for(store.dedup.seen("g", "m1"), 5)
            assert not await asyncio.wait_for(store.dedup.seen("g", "m2"), 5)
            pending = await asyncio.wait_for(store.outbox.pending(), 5)
            assert [m.topic for m in pending] == ["t"]
        finally:
            release.set()
            await blocked


async def test_the_look_sees_what_the_transaction_under_way_commits(tmp_path: Path) -> None:
    async with SqliteStore(str(tmp_path / "r.db")) as store:
        committing = asyncio.Event()

        async def write() -> None:
            async with store.transaction() as tx:
                await store.outbox.add([("t", to_envelope(Note(text="a"), source="t"))], tx=tx)
                committing.set()
                await asyncio.sleep(0.05)

        writer = asyncio.create_task(write())
        await committing.wait()
        pending = await store.outbox.pending()  # waits for the transaction's end
        await writer
        assert [m.topic for m in pending] == ["t"]


async def test_a_look_at_large_payloads_reads_them_all_in_order(tmp_path: Path) -> None:
    async with SqliteStore(str(tmp_path / "r.db")) as store:
        big = "x" * (INLINE_BYTES // 2)
        notes = [("t", to_envelope(Note(text=f"{n}{big}"), source="t")) for n in range(5)]
        await store.outbox.add(notes)
        pending = await store.outbox.pending(3)
        assert [m.message_id for m in pending] == [env.id for _, env in notes[:3]]
        assert [m.payload for m in pending] == [env.to_bytes() for _, env in notes[:3]]


async def test_a_read_that_cannot_run_at_once_goes_to_the_thread(tmp_path: Path) -> None:
    async with SqliteStore(str(tmp_path / "r.db")) as store:
        await store.dedup.mark("g", "m1")
        await store.outbox.add([("t", to_envelope(Note(text="a"), source="t"))])
        store.dedup._cache.clear()  # answered by the file, not the cache
        # A reader that cannot open its file fails at once (as one that finds the file
        # busy does): the thread answers instead.
        store.db._reader = Reader(str(tmp_path))  # a directory
        assert await store.dedup.seen("g", "m1")
        assert not await store.dedup.seen("g", "m2")
        assert [m.topic for m in await store.outbox.pending()] == ["t"]
