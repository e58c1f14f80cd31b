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


async def test_the_dedup_check_answers_while_the_thread_is_busy(tmp_path: Path) -> None:
    path = str(tmp_path / "r.db")
    async with SqliteStore(path) as store, SqliteStore(path) as other:
        await other.dedup.mark("g", "m1")  # another store on the file: not in the cache
        release = threading.Event()
        blocked = store.db._worker.submit(release.wait, 10)  # type: ignore[union-attr]
        try:
            # It does not wait for the thread: it reads in the event loop.
            assert await asyncio.wait_for(store.dedup.seen("g", "m1"), 5)
            assert not await asyncio.wait_for(store.dedup.seen("g", "m2"), 5)
        finally:
            release.set()
            await blocked


async def test_a_small_look_makes_no_trip_to_the_thread_once_it_is_idle(tmp_path: Path) -> None:
    path = str(tmp_path / "r.db")
    async with SqliteStore(path) as store, SqliteStore(path) as other:
        await other.outbox.add([("t", to_envelope(Note(text="a"), source="t"))])
        release = threading.Event()
        worker = store.db._worker
        assert worker is not None
        blocked = worker.submit(release.wait, 10)
        look = asyncio.create_task(store.outbox.pending())
        await asyncio.sleep(0.02)
        assert not look.done()  # a job on the thread may commit what it must see: it waits
        release.set()
        await blocked
        assert [m.topic for m in await look] == ["t"]
        trips = worker._submitted
        assert [m.topic for m in await store.outbox.pending()] == ["t"]
        assert worker._submitted == trips  # read in the event loop


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


async def test_a_look_after_a_removal_still_on_the_thread_does_not_see_the_removed_rows(
    tmp_path: Path,
) -> None:
    async with SqliteStore(str(tmp_path / "r.db")) as store:
        await store.outbox.add([("t", to_envelope(Note(text=str(n)), source="t")) for n in "ab"])
        sent = await store.outbox.pending()
        release = threading.Event()
        worker = store.db._worker
        assert worker is not None
        blocked = worker.submit(release.wait, 10)
        # The removal's transaction is given to the thread and does not hold the lock while
        # it waits there; the look that follows must still see its outcome.
        removal = asyncio.create_task(store.outbox.remove([sent[0].seq]))
        await asyncio.sleep(0)
        look = asyncio.create_task(store.outbox.pending())
        await asyncio.sleep(0.02)
        release.set()
        await blocked
        await removal
        assert [m.seq for m in await look] == [sent[1].seq]
