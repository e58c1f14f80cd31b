"""Lease tables made by earlier versions: a SQLite file whose ``ef_leases`` has no epoch
column gets one at the first open (its rows at epoch 0, so the next holder takes epoch 1),
and a release keeps the row, so the epoch never goes back."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from eventflow.adapters.sqlite.store import SqliteStore
from eventflow.errors import LeaseLostError

# ef_leases as eventflow wrote it before leases had epochs (frozen on purpose)
_OLD_LEASES = """
CREATE TABLE ef_leases (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at REAL NOT NULL
);
"""


async def test_an_old_sqlite_lease_table_gets_its_epoch_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(_OLD_LEASES)
        conn.execute(
            "INSERT INTO ef_leases VALUES ('projection:old', 'gone:1', ?)", (time.time() - 60,)
        )
    first, second = SqliteStore(str(path), lease_ttl=2.0), SqliteStore(str(path))
    await first.open()
    await second.open()  # a second open finds it upgraded
    try:
        async with first.leases.hold("projection:old") as lease:
            assert lease.epoch == 1  # the expired row of the old holder is taken over
            await first.checkpoints.set("old", 1, lease=lease)
        async with second.leases.hold("projection:old") as newer:
            assert newer.epoch == 2
            with pytest.raises(LeaseLostError):
                await first.checkpoints.set("old", 2, lease=lease)
        with sqlite3.connect(path) as conn:
            rows = conn.execute("SELECT name, epoch FROM ef_leases").fetchall()
        assert rows == [("projection:old", 2)]  # released, not deleted: the epoch stays
    finally:
        await first.close()
        await second.close()
