"""The store contract's tests of processes sharing one backend: racing writers, and the
store's lifecycle (open, close, creating the schema, several stores opening at once)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from ...errors import ConcurrencyError
from .support import (
    StoreContractBase,
    StoreFactory,
    _notes,
    _stream,
    _versions,
    following,
    happened,
    read_all,
    read_stream,
)

__all__ = ["ConcurrencyContract"]


class ConcurrencyContract(StoreContractBase):
    """Racing writers and processes sharing one backend; open, close and the schema."""

    # -- concurrency -------------------------------------------------------------------------

    async def test_concurrent_appends_with_expected_version_one_winner_per_version(
        self, store_factory: StoreFactory
    ) -> None:
        """Writers racing for the same expected version: exactly one wins, the others get
        ``ConcurrencyError(stream, expected, actual=the winner's version)``."""
        stores = [await store_factory() for _ in range(3)]
        s = _stream()
        writers, rounds, size = 4, 6, 2

        async def attempt(writer: int, expected: int) -> int:
            events = happened(size, note=f"w{writer}v{expected}")
            return await stores[writer % len(stores)].append(s, events, expected_version=expected)

        winners: list[int] = []
        for r in range(rounds):
            expected = r * size
            async with asyncio.timeout(self.timeout):
                results = await asyncio.gather(
                    *(attempt(w, expected) for w in range(writers)), return_exceptions=True
                )
            won = [w for w, res in enumerate(results) if not isinstance(res, BaseException)]
            assert len(won) == 1, f"round {r}: {results}"
            assert results[won[0]] == expected + size
            winners.append(won[0])
            for res in results:
                if isinstance(res, BaseException):
                    assert isinstance(res, ConcurrencyError), res
                    assert (res.stream, res.expected, res.actual) == (s, expected, expected + size)

        records = await read_stream(stores[0], s)
        assert _versions(records) == list(range(1, rounds * size + 1))
        notes = _notes(records)
        assert notes == [f"w{w}v{r * size}" for r, w in enumerate(winners) for _ in range(size)]
        assert [rec.position for rec in await read_all(stores[1])] == list(
            range(1, rounds * size + 1)
        )

    async def test_racing_writers_with_retries_keep_versions_contiguous(
        self, store_factory: StoreFactory
    ) -> None:
        """Writers that reload and retry on conflict: every batch lands whole, in consecutive
        versions, versions 1..N without gaps or repeats."""
        stores = [await store_factory() for _ in range(3)]
        s = _stream()
        writers, batches = 4, 5

        async def writer(w: int) -> None:
            store = stores[w % len(stores)]
            for b in range(batches):
                events = happened(w % 3 + 1, note=f"w{w}b{b}")
                while True:
                    current = await store.stream_version(s)
                    try:
                        await store.append(s, events, expected_version=current)
                        break
                    except ConcurrencyError as exc:
                        assert exc.expected == current and exc.actual != current

        async with asyncio.timeout(self.timeout * 3), asyncio.TaskGroup() as tg:
            for w in range(writers):
                tg.create_task(writer(w))

        records = await read_stream(stores[0], s)
        total = sum(w % 3 + 1 for w in range(writers)) * batches
        assert _versions(records) == list(range(1, total + 1))
        notes = _notes(records)
        runs: list[tuple[str, int]] = []
        for note in notes:
            if runs and runs[-1][0] == note:
                runs[-1] = (note, runs[-1][1] + 1)
            else:
                runs.append((note, 1))
        assert sorted(runs) == sorted(
            (f"w{w}b{b}", w % 3 + 1) for w in range(writers) for b in range(batches)
        ), "a batch was split or repeated"

    async def test_concurrent_appends_to_many_streams_keep_positions_gapless(
        self, store_factory: StoreFactory
    ) -> None:
        """Many writers on their own streams at once: positions 1..N unique and gapless, each
        stream in version order within the global order, and a live subscriber receives
        exactly that sequence (none skipped, even one committed late by a slower writer)."""
        stores = [await store_factory() for _ in range(3)]
        writers, appends = 8, 12
        appended: dict[str, list[int]] = defaultdict(list)

        async def writer(w: int) -> None:
            store = stores[w % len(stores)]
            for j in range(appends):
                s = f"contract-many-{w}-{j % 2}"
                version = await store.append(s, happened(j % 3 + 1, note=f"w{w}j{j}"))
                appended[s].append(version)

        async with following(stores[0]) as follower:
            async with asyncio.timeout(self.timeout * 3), asyncio.TaskGroup() as tg:
                for w in range(writers):
                    tg.create_task(writer(w))
            total = writers * sum(j % 3 + 1 for j in range(appends))
            await follower.wait_for(total, timeout=self.timeout)

        everything = await read_all(stores[1])
        assert [rec.position for rec in everything] == list(range(1, total + 1))
        assert await stores[2].last_position() == total
        assert len({rec.envelope.id for rec in everything}) == total
        assert follower.records == everything
        by_stream: dict[str, list[int]] = defaultdict(list)
        for rec in everything:
            by_stream[rec.stream_id].append(rec.stream_version)
        for s, versions in by_stream.items():
            assert versions == list(range(1, len(versions) + 1)), s
            assert appended[s] == sorted(appended[s]) and appended[s][-1] == len(versions)
        assert len(by_stream) == writers * 2

    # -- lifecycle and schema ----------------------------------------------------------------

    async def test_open_and_close_are_idempotent(self, store_factory: StoreFactory) -> None:
        """open twice, close twice: no error; what was appended is there for the next store."""
        store = await store_factory(opened=False)
        await store.open()
        await store.open()
        s = _stream()
        await store.append(s, happened(2))
        await store.close()
        await store.close()
        again = await store_factory()
        assert _versions(await read_stream(again, s)) == [1, 2]
        assert await again.last_position() == 2

    async def test_a_fresh_backend_works_without_an_init_step(
        self, store_factory: StoreFactory
    ) -> None:
        """Opening a never-used backend creates the schema: every read works at once (before
        any write) and answers 'empty', then writes work."""
        store = await store_factory()
        s = _stream()
        assert await store.last_position() == 0
        assert await store.stream_version(s) == 0
        assert await read_all(store) == []
        assert await read_stream(store, s) == []
        assert await store.load_snapshot(s) is None
        assert await store.checkpoints.get("never-set") == 0
        assert await store.checkpoints.list() == {}
        assert await store.outbox.pending() == []
        assert not await store.dedup.seen("g", "never-marked")
        assert await store.append(s, happened(1), expected_version=0) == 1

    async def test_several_stores_opening_a_fresh_backend_at_once(
        self, store_factory: StoreFactory
    ) -> None:
        """Processes starting together on an empty backend all open it (the schema is
        created once, without errors) and share one log."""
        stores = [await store_factory(opened=False) for _ in range(4)]
        async with asyncio.timeout(self.timeout):
            await asyncio.gather(*(store.open() for store in stores))
        s = _stream()
        for i, store in enumerate(stores):
            assert await store.append(s, happened(1, start=i), expected_version=i) == i + 1
        for store in stores:
            assert _versions(await read_stream(store, s)) == [1, 2, 3, 4]
