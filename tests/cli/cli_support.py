"""Helpers for the command-line tests: fill a SQLite store through the store API."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from eventflow import DeadLetter, open_store
from eventflow.ports import Heartbeat


def make_letter(n: int, *, group: str = "billing", **fields: object) -> DeadLetter:
    """A dead letter with recognisable values."""
    values: dict[str, object] = {
        "id": f"dl-{n}",
        "topic": "invoice.created",
        "group": group,
        "payload": b'{"id": "e-%d", "type": "invoice.created", "data": {"n": %d}}' % (n, n),
        "error": f"ValueError: amount {n} is negative\nTraceback (most recent call last): ...",
        "attempts": 3,
        "failed_at": datetime(2026, 1, 2, 3, 4, n, tzinfo=UTC),
        "reason": "handler-failed",
        "key": f"inv-{n}",
        "headers": {"traceparent": "00-abc-def-01"},
        "envelope_id": f"e-{n}",
        "source": {"partition": 1, "offset": n},
    }
    values.update(fields)
    return DeadLetter(**values)  # type: ignore[arg-type]


def make_beat(app: str, *, age: float = 1.0, **fields: object) -> Heartbeat:
    """A heartbeat last seen ``age`` seconds ago."""
    now = datetime.now(UTC)
    values: dict[str, object] = {
        "app": app,
        "instance": f"{app}@host:42:abc",
        "host": "host",
        "pid": 42,
        "started_at": now - timedelta(minutes=5),
        "last_seen": now - timedelta(seconds=age),
        "subscriptions": (f"{app}:invoice.*",),
        "stats": {"received": 12, "handled": 10, "duplicates": 2, "retries": 0},
    }
    values.update(fields)
    return Heartbeat(**values)  # type: ignore[arg-type]


def fill(url: str, letters: Iterable[DeadLetter] = (), beats: Iterable[Heartbeat] = ()) -> None:
    """Write letters and heartbeats through the store API."""

    async def go() -> None:
        async with open_store(url) as store:
            for letter in letters:
                await store.dead_letters.add(letter)
            for beat in beats:
                await store.heartbeats.beat(beat)

    asyncio.run(go())


def letter_ids(url: str) -> list[str]:
    """The ids of the letters in the store, oldest first."""

    async def go() -> list[str]:
        async with open_store(url) as store:
            return [d.id for d in await store.dead_letters.list(limit=1000)]

    return asyncio.run(go())
