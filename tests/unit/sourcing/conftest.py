"""The event stores the sourcing tests run against: memory and SQLite (a file per test)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eventflow.adapters.memory import MemoryStore
from eventflow.ports import Store
from eventflow.stores import store_for


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """An open, empty event store."""
    if request.param == "memory":
        opened: Store = MemoryStore()
    else:
        opened = store_for("sqlite:///" + str(tmp_path / "events.db"))
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()
