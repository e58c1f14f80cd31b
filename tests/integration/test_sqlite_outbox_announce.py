"""SQLite's wake-up across processes (``notify.py``): a store that commits outbox rows tells
the relay listening on the file at once, with no check of the file, and only once its
transaction committed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from eventflow import Event
from eventflow.adapters.sqlite import SqliteStore
from eventflow.events import to_envelope
from eventflow.testing import eventually


class Note(Event, type="it.sqlite.announce.note"):
    text: str


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="announcements use Linux's abstract sockets"
)


async def test_a_relay_hears_another_store_commit_outbox_rows(tmp_path: Path) -> None:
    path = str(tmp_path / "a.db")
    async with SqliteStore(path) as relaying, SqliteStore(path) as other:
        added = relaying.outbox.added
        async with relaying.outbox.relaying():
            assert added.listening
            added.clear()
            async with other.transaction() as tx:
                await other.outbox.add([("t", to_envelope(Note(text="a"), source="t"))], tx=tx)
                await asyncio.sleep(0.02)
                assert not added.is_set()  # not before the commit
            # Nobody waits on ``added``, so the high-water mark is not checked: only the
            # announcement can set it.
            await eventually(added.is_set, timeout=5, message="the relay was not told")
            added.clear()
            await other.outbox.add([("t", to_envelope(Note(text="b"), source="t"))])
            await eventually(added.is_set, timeout=5, message="the relay was not told")
        assert not added.listening


async def test_commit_hooks_run_once_after_a_commit_and_never_after_a_rollback(
    tmp_path: Path,
) -> None:
    async with SqliteStore(str(tmp_path / "a.db")) as store:
        db = store.db
        ran: list[str] = []
        assert not db.after_commit(None, lambda: ran.append("none"))  # no transaction open
        with pytest.raises(RuntimeError):
            async with db.transaction() as tx:
                await tx.execute(
                    "INSERT INTO ef_outbox (topic, payload, message_id) VALUES ('t', x'00', 'm')"
                )
                assert db.after_commit(tx, lambda: ran.append("rolled back"))
                raise RuntimeError("roll back")

        def committed() -> None:
            ran.append("committed")

        async with db.transaction() as tx:
            await tx.execute(
                "INSERT INTO ef_outbox (topic, payload, message_id) VALUES ('t', x'00', 'm')"
            )
            assert db.after_commit(None, committed)  # the context's open transaction
            assert db.after_commit(tx, committed)
        assert ran == ["committed"]


async def test_a_second_relay_of_the_file_in_one_process_leaves_the_name_to_the_first(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "a.db")
    async with SqliteStore(path) as first, SqliteStore(path) as second:
        async with first.outbox.relaying(), second.outbox.relaying():
            assert first.outbox.added.listening
            assert not second.outbox.added.listening  # the high-water mark check wakes it
        async with second.outbox.relaying():
            assert second.outbox.added.listening  # the first freed the name
