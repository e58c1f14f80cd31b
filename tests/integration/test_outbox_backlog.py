"""``Outbox.backlog`` (what the metrics read) leaves the relay's wake-ups alone: on SQLite,
a message another process adds still wakes the waiting relay after a scrape counted it
(reading it with ``pending`` would have marked it seen, and the relay would have slept
until its poll)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from eventflow import Envelope
from eventflow.stores import open_store


async def test_a_counted_message_still_wakes_the_relay(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    async with open_store(url) as relaying, open_store(url) as other:
        # The relay looked once (nothing), then waits for a wake-up.
        assert await relaying.outbox.pending() == []
        relaying.outbox.added.clear()
        message = ("it.backlog.sent", Envelope.create("it.backlog.sent", {"n": 1}))
        await other.outbox.add([message])  # another process's add: no event of this store
        count, oldest = await relaying.outbox.backlog()
        assert count == 1 and oldest is not None and oldest.message_id == message[1].id
        woken = asyncio.ensure_future(relaying.outbox.added.wait())
        try:
            done, _ = await asyncio.wait({woken}, timeout=10)
            assert woken in done, "the relay was not woken for a message a scrape had counted"
        finally:
            woken.cancel()
