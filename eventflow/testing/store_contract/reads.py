"""The store contract's read tests: ``read_stream``, ``read_all``, ``correlated``,
``last_position`` and snapshots."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ...envelope import Envelope
from ...errors import ConcurrencyError
from ...ports import Snapshot, Store
from .support import (
    Happened,
    StoreContractBase,
    _envelopes,
    _ns,
    _stream,
    _versions,
    happened,
    read_all,
    read_stream,
)

__all__ = ["ReadContract"]


class ReadContract(StoreContractBase):
    """Reading: ``read_stream``, ``read_all``, ``last_position`` and snapshots."""

    # -- correlated --------------------------------------------------------------------------

    async def test_correlated_finds_one_correlation_in_order(self, store: Store) -> None:
        """The events of one correlation id across streams, oldest first, with their
        positions, and nothing of another correlation; ``limit`` bounds them."""
        corr, other = str(uuid.uuid4()), str(uuid.uuid4())

        def env(n: int, correlation: str) -> Envelope:
            data = {"n": n, "note": "", "tags": []}
            return Envelope.create(Happened.event_type, data, correlation_id=correlation)

        a, b = _stream(), _stream()
        await store.append(a, [env(0, corr), env(1, other)])
        await store.append(b, [env(2, corr)])
        await store.append(a, [env(3, corr)])
        found = await store.correlated(corr)
        assert [r.envelope.data["n"] for r in found] == [0, 2, 3]
        assert [r.stream_id for r in found] == [a, b, a]
        everything = {r.envelope.id: r.position for r in await read_all(store)}
        assert [r.position for r in found] == [everything[r.envelope.id] for r in found]
        assert [r.envelope.data["n"] for r in await store.correlated(corr, limit=2)] == [0, 2]
        assert await store.correlated(str(uuid.uuid4())) == []

    # -- read_stream -------------------------------------------------------------------------

    async def _five_in(self, store: Store) -> str:
        """A stream of 5 events (ns 0..4), interleaved with another stream's events."""
        s, other = _stream(), _stream()
        await store.append(s, happened(2))
        await store.append(other, happened(2, start=100))
        await store.append(s, happened(3, start=2))
        await store.append(other, happened(1, start=102))
        return s

    async def test_read_stream_forwards(self, store: Store) -> None:
        """From the start or from a version, in version order; past the end, nothing."""
        s = await self._five_in(store)
        records = await read_stream(store, s)
        assert _versions(records) == [1, 2, 3, 4, 5]
        assert _ns(records) == [0, 1, 2, 3, 4]
        assert all(rec.stream_id == s for rec in records)
        positions = [rec.position for rec in records]
        assert positions == sorted(positions) and len(set(positions)) == 5
        assert _versions(await read_stream(store, s, from_version=1)) == [1, 2, 3, 4, 5]
        assert _versions(await read_stream(store, s, from_version=3)) == [3, 4, 5]
        assert _versions(await read_stream(store, s, from_version=5)) == [5]
        assert await read_stream(store, s, from_version=6) == []

    async def test_read_stream_backwards(self, store: Store) -> None:
        """Backwards from the end, or from a version down to 1, newest first."""
        s = await self._five_in(store)
        assert _versions(await read_stream(store, s, backwards=True)) == [5, 4, 3, 2, 1]
        assert _versions(await read_stream(store, s, backwards=True, from_version=3)) == [3, 2, 1]
        assert _versions(await read_stream(store, s, backwards=True, from_version=1)) == [1]
        forwards = await read_stream(store, s)
        assert await read_stream(store, s, backwards=True) == forwards[::-1]

    async def test_read_stream_limit(self, store: Store) -> None:
        """``limit`` caps how many events come back, in either direction."""
        s = await self._five_in(store)
        assert _versions(await read_stream(store, s, limit=2)) == [1, 2]
        assert _versions(await read_stream(store, s, from_version=2, limit=2)) == [2, 3]
        assert _versions(await read_stream(store, s, from_version=4, limit=10)) == [4, 5]
        assert _versions(await read_stream(store, s, backwards=True, limit=2)) == [5, 4]
        assert _versions(await read_stream(store, s, backwards=True, from_version=4, limit=2)) == [
            4,
            3,
        ]
        assert _versions(await read_stream(store, s, limit=5)) == [1, 2, 3, 4, 5]

    async def test_unknown_stream_reads_empty(self, store: Store) -> None:
        """A stream that does not exist yields nothing and is at version 0."""
        await store.append(_stream(), happened(1))
        s = _stream()
        assert await read_stream(store, s) == []
        assert await read_stream(store, s, backwards=True) == []
        assert await read_stream(store, s, from_version=1, limit=3) == []
        assert await store.stream_version(s) == 0
        assert await store.load_snapshot(s) is None

    async def test_versions_are_contiguous_from_1(self, store: Store) -> None:
        """Whatever the batch sizes, a stream's versions are 1..N and its positions rise."""
        s = _stream()
        for size in (1, 3, 1, 4, 2):
            await store.append(s, happened(size))
            await store.append(_stream(), happened(1))
        records = await read_stream(store, s)
        assert _versions(records) == list(range(1, 12))
        positions = [rec.position for rec in records]
        assert positions == sorted(positions)
        assert await store.stream_version(s) == 11

    # -- read_all ----------------------------------------------------------------------------

    async def test_read_all_in_global_order(self, store: Store) -> None:
        """Positions are 1..N without gaps, in append order across streams."""
        a, b, c = _stream(), _stream(), _stream()
        plan = [(a, 1), (b, 1), (a, 2), (c, 1), (b, 3), (a, 1)]
        expected: list[tuple[str, int]] = []
        for stream_id, size in plan:
            start = await store.stream_version(stream_id)
            await store.append(stream_id, happened(size, start=start))
            expected += [(stream_id, start + i + 1) for i in range(size)]
        records = await read_all(store)
        assert [(rec.stream_id, rec.stream_version) for rec in records] == expected
        assert [rec.position for rec in records] == list(range(1, len(expected) + 1))
        assert await store.last_position() == len(expected)
        for stream_id in (a, b, c):
            assert await read_stream(store, stream_id) == [
                rec for rec in records if rec.stream_id == stream_id
            ]

    async def test_read_all_after_and_limit(self, store: Store) -> None:
        """``after`` skips positions up to it; ``limit`` caps the count."""
        s = _stream()
        await store.append(s, happened(6))
        await store.append(_stream(), happened(4))

        async def positions(**options: Any) -> list[int]:
            return [rec.position for rec in await read_all(store, **options)]

        assert await positions() == list(range(1, 11))
        assert await positions(after=0) == list(range(1, 11))
        assert await positions(after=4) == list(range(5, 11))
        assert await positions(after=9) == [10]
        assert await positions(after=10) == []
        assert await positions(after=50) == []
        assert await positions(limit=3) == [1, 2, 3]
        assert await positions(after=5, limit=3) == [6, 7, 8]
        assert await positions(after=8, limit=5) == [9, 10]
        assert await read_all(store, after=3, limit=2) == (await read_all(store))[3:5]

    async def test_appends_are_visible_to_readers_at_once(self, store: Store) -> None:
        """Once ``append`` returns, ``last_position``, ``read_all`` and ``read_stream`` of the
        same store include its events (read your writes)."""
        for i in range(20):
            s = _stream()
            await store.append(s, happened(1))
            assert await store.last_position() == i + 1, f"append {i + 1}"
            assert [rec.position for rec in await read_all(store, after=i)] == [i + 1]
            assert [rec.position for rec in await read_stream(store, s)] == [i + 1]

    async def test_last_position(self, store: Store) -> None:
        """0 when empty; the newest position after appends; unchanged by no-op appends."""
        assert await store.last_position() == 0
        s = _stream()
        batch = _envelopes(3)
        await store.append(s, batch)
        assert await store.last_position() == 3
        await store.append(s, batch)  # all stored already
        await store.append(s, [])
        with pytest.raises(ConcurrencyError):
            await store.append(s, happened(1), expected_version=0)
        assert await store.last_position() == 3
        await store.append(_stream(), happened(2))
        assert await store.last_position() == 5
        assert (await read_all(store))[-1].position == 5

    # -- snapshots ---------------------------------------------------------------------------

    async def test_snapshots_save_load_replace(self, store: Store) -> None:
        """A snapshot comes back as saved; saving again replaces it; each stream has its own;
        with ``stream_version`` and ``read_stream(from_version=...)`` it rebuilds the state."""
        s, other = _stream(), _stream()
        await store.append(s, happened(3))
        assert await store.load_snapshot(s) is None
        taken = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
        first = Snapshot(
            s, 3, {"status": "placed", "lines": [{"sku": "a", "qty": 2}], "note": "ü"}, taken
        )
        await store.save_snapshot(first)
        loaded = await store.load_snapshot(s)
        assert loaded == first
        assert loaded is not None and loaded.taken_at == taken

        await store.append(s, happened(2, start=3))
        second = Snapshot(s, 5, {"status": "shipped", "lines": []}, taken + timedelta(seconds=1))
        await store.save_snapshot(second)
        assert await store.load_snapshot(s) == second
        assert await store.load_snapshot(other) is None

        third = Snapshot(other, 0, {}, taken)
        await store.save_snapshot(third)
        assert await store.load_snapshot(other) == third
        assert await store.load_snapshot(s) == second

        snap = await store.load_snapshot(s)
        assert snap is not None
        await store.append(s, happened(1, start=5))
        rest = await read_stream(store, s, from_version=snap.version + 1)
        assert _versions(rest) == [6]
        assert await store.stream_version(s) == 6
