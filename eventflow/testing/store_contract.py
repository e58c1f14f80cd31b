"""The event store's contract suite (``EventStore`` and the ``Store`` parts built on it),
shared by every store adapter.

An adapter's test module subclasses :class:`StoreContract` and provides one fixture,
``store_factory``: a :class:`StoreFactory` returning stores connected to one fresh, empty
backend (a new file, database or schema per test), each like another process of the same
deployment, all closed after the test::

    class TestSqliteStore(StoreContract):
        @pytest.fixture
        async def store_factory(self, tmp_path: Path) -> AsyncIterator[StoreFactory]:
            url = f"sqlite:///{tmp_path}/events.db"
            async with store_pool(lambda: store_for(url)) as factory:
                yield factory

A single-process backend (memory) returns the same store every time. Because the backend
is fresh, positions start at 1 in every test; stream names are unique all the same.
Waits are bounded polls; a subclass on a slow backend raises ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, Protocol

import pytest

from ..envelope import Envelope, new_id
from ..errors import ConcurrencyError, ConfigurationError, EventflowError, StoreError
from ..events import Event
from ..ports import (
    Checkpoints,
    DedupStore,
    EventStore,
    Outbox,
    OutboxMessage,
    RecordedEvent,
    Snapshot,
    Store,
)
from .broker_contract import eventually, unique_name

__all__ = [
    "Follower",
    "Happened",
    "StoreContract",
    "StoreFactory",
    "following",
    "happened",
    "read_all",
    "read_stream",
    "store_pool",
]

DEFAULT_TIMEOUT = 10.0
DEFAULT_QUIET_PERIOD = 0.3


class Happened(Event, type="eventflow.contract.happened"):
    """The event the contract suite appends."""

    n: int
    note: str = ""
    tags: list[str] = []


def happened(count: int, *, start: int = 0, note: str = "") -> list[Happened]:
    """``count`` events numbered from ``start``."""
    return [Happened(n=i, note=note) for i in range(start, start + count)]


def _envelopes(count: int, *, note: str = "") -> list[Envelope]:
    """``count`` envelopes with ids of their own (as a retried command would resend)."""
    return [
        Envelope.create(Happened.event_type, {"n": i, "note": note, "tags": []})
        for i in range(count)
    ]


class StoreFactory(Protocol):
    """Returns a store on the test's backend (opened unless ``opened=False``); the fixture
    closes every store it returned after the test."""

    async def __call__(self, *, opened: bool = True) -> Store:
        """A store connected to the test's backend."""


@asynccontextmanager
async def store_pool(make: Callable[[], Store]) -> AsyncIterator[StoreFactory]:
    """Yield a :class:`StoreFactory` over stores built by ``make``; close them all at exit."""
    stores: list[Store] = []

    async def factory(*, opened: bool = True) -> Store:
        store = make()
        stores.append(store)
        if opened:
            await store.open()
        return store

    try:
        yield factory
    finally:
        for store in reversed(stores):
            await store.close()


async def read_stream(store: EventStore, stream_id: str, **options: Any) -> list[RecordedEvent]:
    """Every record ``store.read_stream(stream_id, **options)`` yields."""
    return [rec async for rec in store.read_stream(stream_id, **options)]


async def read_all(store: EventStore, **options: Any) -> list[RecordedEvent]:
    """Every record ``store.read_all(**options)`` yields."""
    return [rec async for rec in store.read_all(**options)]


class Follower:
    """Records what ``store.subscribe(after=...)`` delivers; run by :func:`following`."""

    def __init__(self, store: EventStore, after: int) -> None:
        self.store = store
        self.after = after
        self.records: list[RecordedEvent] = []
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Subscribe and record until cancelled."""
        async for rec in self.store.subscribe(after=self.after):
            self.records.append(rec)

    async def wait_for(self, count: int, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Wait until at least ``count`` records arrived; fail after ``timeout``."""

        def arrived() -> bool:
            if self.task is not None and self.task.done():
                self.task.result()  # raises what broke the subscription
                raise AssertionError("subscribe() ended; it must follow the log forever")
            return len(self.records) >= count

        await eventually(
            arrived,
            timeout=timeout,
            message=f"subscriber received {count} events (has {len(self.records)})",
        )

    def positions(self) -> list[int]:
        """The positions received so far."""
        return [rec.position for rec in self.records]


@asynccontextmanager
async def following(store: EventStore, *, after: int = 0) -> AsyncIterator[Follower]:
    """Run a :class:`Follower` in a task for the block; cancel it (and check it stopped
    cleanly) at exit."""
    follower = Follower(store, after)
    follower.task = asyncio.create_task(follower.run(), name="store-contract-follower")
    try:
        yield follower
    finally:
        follower.task.cancel()
        [outcome] = await asyncio.gather(follower.task, return_exceptions=True)
    if not isinstance(outcome, asyncio.CancelledError):
        raise AssertionError(f"the subscriber did not stop cleanly: {outcome!r}")


def _event(rec: RecordedEvent) -> Happened:
    event = rec.event
    assert isinstance(event, Happened), event
    return event


def _ns(records: Sequence[RecordedEvent]) -> list[int]:
    return [_event(rec).n for rec in records]


def _notes(records: Sequence[RecordedEvent]) -> list[str]:
    return [_event(rec).note for rec in records]


def _ids(records: Sequence[RecordedEvent]) -> list[str]:
    return [rec.envelope.id for rec in records]


def _versions(records: Sequence[RecordedEvent]) -> list[int]:
    return [rec.stream_version for rec in records]


def _stream() -> str:
    return f"contract-{unique_name('s')}"


class StoreContract:
    """The guarantees of :class:`eventflow.ports.EventStore` and of the transactional parts
    of :class:`eventflow.ports.Store`, as tests every store adapter must pass.

    Subclass it as ``class TestXStore(StoreContract)`` and provide the ``store_factory``
    fixture (see the module docstring). No ``Test`` prefix, so pytest collects it only
    through its subclasses.
    """

    timeout: float = DEFAULT_TIMEOUT
    """Seconds to wait for something that must happen."""
    quiet_period: float = DEFAULT_QUIET_PERIOD
    """Seconds to watch for something that must not happen (a lock taken twice)."""

    @pytest.fixture
    async def store(self, store_factory: StoreFactory) -> Store:
        """An opened store on the test's fresh backend."""
        return await store_factory()

    # -- append ------------------------------------------------------------------------------

    async def test_store_implements_the_ports(self, store: Store) -> None:
        """The store and its parts satisfy the runtime-checkable Protocols."""
        assert isinstance(store, EventStore)
        assert isinstance(store, Store)
        assert isinstance(store.checkpoints, Checkpoints)
        assert isinstance(store.outbox, Outbox)
        assert isinstance(store.dedup, DedupStore)

    async def test_append_returns_the_new_version(self, store: Store) -> None:
        """Each append returns the stream's version after it; versions count events."""
        s = _stream()
        assert await store.append(s, happened(2)) == 2
        assert await store.append(s, happened(3, start=2)) == 5
        assert await store.append(s, happened(1, start=5)) == 6
        assert await store.stream_version(s) == 6
        assert _ns(await read_stream(store, s)) == list(range(6))

    async def test_expected_version_none_zero_and_n(self, store: Store) -> None:
        """0 means the stream must not exist, N that it is at N, None that anything goes."""
        s = _stream()
        assert await store.append(s, happened(1), expected_version=0) == 1
        with pytest.raises(ConcurrencyError):
            await store.append(s, happened(1), expected_version=0)
        assert await store.append(s, happened(2), expected_version=1) == 3
        assert await store.append(s, happened(1), expected_version=None) == 4
        assert await store.append(s, happened(1)) == 5
        with pytest.raises(ConcurrencyError):
            await store.append(s, happened(1), expected_version=4)
        with pytest.raises(ConcurrencyError):
            await store.append(s, happened(1), expected_version=6)
        assert await store.append(s, happened(1), expected_version=5) == 6
        assert await store.stream_version(s) == 6

    async def test_concurrency_error_names_stream_expected_and_actual(self, store: Store) -> None:
        """The error carries (stream, expected, actual), says what to do, and appends nothing."""
        s = _stream()
        await store.append(s, happened(2))
        position = await store.last_position()
        with pytest.raises(ConcurrencyError) as info:
            await store.append(s, happened(3), expected_version=1)
        err = info.value
        assert (err.stream, err.expected, err.actual) == (s, 1, 2)
        assert isinstance(err, StoreError)
        assert isinstance(err, EventflowError)
        message = str(err)
        assert repr(s) in message
        assert "version 2" in message
        assert "expected 1" in message
        assert "retry" in message
        assert await store.stream_version(s) == 2
        assert await store.last_position() == position

    async def test_expected_version_on_a_new_stream_fails(self, store: Store) -> None:
        """Expecting version N>0 of a stream that does not exist raises with actual 0."""
        s = _stream()
        with pytest.raises(ConcurrencyError) as info:
            await store.append(s, happened(1), expected_version=3)
        assert (info.value.stream, info.value.expected, info.value.actual) == (s, 3, 0)
        assert await store.stream_version(s) == 0
        assert await read_stream(store, s) == []
        assert await store.last_position() == 0

    async def test_empty_append_is_a_no_op(self, store: Store) -> None:
        """Appending no events changes nothing and returns the current version."""
        s = _stream()
        assert await store.append(s, []) == 0
        assert await store.stream_version(s) == 0
        assert await store.last_position() == 0
        await store.append(s, happened(2))
        assert await store.append(s, []) == 2
        assert await store.append(s, [], expected_version=2) == 2
        assert await store.last_position() == 2
        assert len(await read_all(store)) == 2

    async def test_events_get_new_uuid7_ids_and_the_stream_as_key(self, store: Store) -> None:
        """Event instances are wrapped in envelopes with fresh UUIDv7 ids, key = stream id."""
        s = _stream()
        events = [Happened(n=1, note="a", tags=["x"]), Happened(n=2)]
        await store.append(s, events)
        await store.append(s, [Happened(n=1, note="a", tags=["x"])])  # equal event, new id
        records = await read_stream(store, s)
        ids = _ids(records)
        assert len(set(ids)) == 3
        for rec in records:
            assert uuid.UUID(rec.envelope.id).version == 7
            assert rec.envelope.key == s
            assert rec.envelope.type == "eventflow.contract.happened"
            assert rec.envelope.version == 1
            assert rec.stream_id == s
        assert [rec.event for rec in records] == [*events, events[0]]
        assert records[0].envelope.data == {"n": 1, "note": "a", "tags": ["x"]}

    async def test_envelopes_keep_their_ids_and_fields(self, store: Store) -> None:
        """Envelopes are stored as given: same id, key, correlation and causation."""
        s = _stream()
        envs = [
            Envelope.create(
                Happened.event_type,
                {"n": i, "note": "", "tags": []},
                key=f"custom-key-{i}",
                correlation_id="corr-1",
                causation_id=f"cause-{i}",
            )
            for i in range(3)
        ]
        assert await store.append(s, envs, expected_version=0) == 3
        records = await read_stream(store, s)
        assert [rec.envelope.to_dict() for rec in records] == [e.to_dict() for e in envs]

    async def test_envelope_ids_need_not_be_uuids(self, store: Store) -> None:
        """An envelope id is any non-empty string (CloudEvents ids are), kept as is."""
        s = _stream()
        ids = ["order-1/placed#1", "x", "Ünïcode id ✓"]
        envs = [Envelope.create(Happened.event_type, {"n": i}, id=eid) for i, eid in enumerate(ids)]
        assert await store.append(s, envs) == 3
        assert _ids(await read_stream(store, s)) == ids
        assert await store.append(s, envs[:1]) == 3  # and still deduplicated

    async def test_reappending_the_same_batch_is_idempotent(self, store: Store) -> None:
        """Re-appending stored envelope ids returns the current version, stores nothing
        twice and raises no ConcurrencyError, even with the original expected_version."""
        s = _stream()
        batch = _envelopes(2)
        assert await store.append(s, batch, expected_version=0) == 2
        assert await store.append(s, batch, expected_version=0) == 2
        assert await store.append(s, batch) == 2
        assert await store.append(s, list(reversed(batch)), expected_version=0) == 2
        assert await store.append(s, batch[1:], expected_version=0) == 2

        later = _envelopes(1)
        assert await store.append(s, later, expected_version=2) == 3
        # a retry of the first command after someone else appended: still no error
        assert await store.append(s, batch, expected_version=0) == 3
        assert await store.append(s, later, expected_version=2) == 3

        records = await read_stream(store, s)
        assert _ids(records) == [e.id for e in [*batch, *later]]
        assert _versions(records) == [1, 2, 3]
        assert await store.last_position() == 3
        assert [rec.position for rec in await read_all(store)] == [1, 2, 3]

    async def test_a_batch_mixing_stored_and_new_ids_appends_only_the_new(
        self, store: Store
    ) -> None:
        """Stored ids in a batch are skipped; the new ones are appended in batch order."""
        s = _stream()
        e1, e2, e3, e4, e5 = _envelopes(5)
        await store.append(s, [e1, e2], expected_version=0)
        assert await store.append(s, [e2, e3, e4], expected_version=2) == 4
        assert await store.append(s, [e5, e1]) == 5
        records = await read_stream(store, s)
        assert _ids(records) == [e.id for e in (e1, e2, e3, e4, e5)]
        assert _versions(records) == [1, 2, 3, 4, 5]
        assert [rec.position for rec in await read_all(store)] == [1, 2, 3, 4, 5]

    async def test_an_id_stored_in_another_stream_is_skipped(self, store: Store) -> None:
        """Envelope ids are unique across the store, not per stream."""
        a, b = _stream(), _stream()
        [env] = _envelopes(1)
        await store.append(a, [env])
        assert await store.append(b, [env]) == 0
        assert await store.stream_version(b) == 0
        assert await read_stream(store, b) == []
        assert await store.last_position() == 1
        [rec] = await read_all(store)
        assert rec.stream_id == a

    async def test_a_batch_repeating_an_id_is_refused_whole(self, store: Store) -> None:
        """A batch naming one id twice is refused and nothing of it is stored."""
        s = _stream()
        e1, e2 = _envelopes(2)
        with pytest.raises(ConfigurationError):
            await store.append(s, [e1, e2, e1])
        assert await store.stream_version(s) == 0
        assert await store.last_position() == 0
        assert await store.append(s, [e1, e2]) == 2

    async def test_a_failed_append_leaves_nothing(self, store: Store) -> None:
        """An append refused for its expected version stores none of its events: later
        reads do not see them and their ids are still free."""
        s = _stream()
        await store.append(s, happened(1))
        batch = _envelopes(3)
        with pytest.raises(ConcurrencyError):
            await store.append(s, batch, expected_version=0)
        assert await store.stream_version(s) == 1
        assert await store.last_position() == 1
        assert await read_all(store, after=1) == []
        assert len(await read_stream(store, s)) == 1
        assert await store.append(s, batch, expected_version=1) == 4
        assert _ids(await read_stream(store, s, from_version=2)) == [e.id for e in batch]

    async def test_events_round_trip_exactly(self, store: Store) -> None:
        """Every envelope field comes back unchanged (time to the microsecond, in UTC; JSON
        data of every kind); ``rec.event`` decodes to the typed event."""
        s = _stream()
        when = datetime(2024, 2, 29, 23, 59, 58, 123456, tzinfo=timezone(timedelta(hours=5)))
        env = Envelope.create(
            Happened.event_type,
            {
                "n": 7,
                "note": "ünïcødé \" ' \\ / \n\t 🙂 <&>",
                "tags": ["a", "b", ""],
                "nested": {
                    "float": 0.1,
                    "neg": -2.5e-8,
                    "big": 2**53 + 1,
                    "none": None,
                    "bool": True,
                    "list": [1, "x", None, {"deep": []}],
                    "empty": {},
                },
            },
            version=1,
            source="contract-suite",
            correlation_id="corr-" + new_id(),
            causation_id="cause-" + new_id(),
            key="key-ü",
            headers={
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "x-unicode": "héllo ✓",
                "x-empty": "",
                "x-spaces": "a value with spaces = and ;",
            },
            time=when,
        )
        assert await store.append(s, [env], expected_version=0) == 1
        [rec] = await read_stream(store, s)
        assert rec.stream_id == s
        assert rec.stream_version == 1
        assert rec.position == 1
        assert rec.envelope.to_dict() == env.to_dict()
        assert rec.envelope.time == when
        assert rec.envelope.time.utcoffset() == timedelta(0)
        assert isinstance(rec.envelope.headers, dict)
        assert rec.event == Happened(n=7, note=env.data["note"], tags=["a", "b", ""])
        [via_all] = await read_all(store)
        assert via_all == rec
        async with following(store) as follower:
            await follower.wait_for(1, timeout=self.timeout)
        assert follower.records == [rec]

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

    # -- subscribe ---------------------------------------------------------------------------

    async def test_subscribe_catches_up_then_follows_live_appends(self, store: Store) -> None:
        """A subscriber gets the stored events, then events appended (by another task)
        after it started, each once, in position order."""
        a, b = _stream(), _stream()
        await store.append(a, happened(2))
        await store.append(b, happened(1))
        async with following(store) as follower:
            await follower.wait_for(3, timeout=self.timeout)
            assert follower.positions() == [1, 2, 3]

            async def writer() -> None:
                await store.append(a, happened(1, start=2))
                await store.append(b, happened(2, start=1))
                await store.append(a, happened(1, start=3))

            async with asyncio.TaskGroup() as tg:
                tg.create_task(writer())
            await follower.wait_for(7, timeout=self.timeout)
            # one more live append, after the subscriber has gone idle
            await store.append(b, happened(1, start=3))
            await follower.wait_for(8, timeout=self.timeout)
        assert follower.records == await read_all(store)
        assert follower.positions() == list(range(1, 9))

    async def test_subscribe_after_a_position(self, store: Store) -> None:
        """``after`` skips what came before; ``after=last_position`` gets only new events."""
        s = _stream()
        await store.append(s, happened(5))
        last = await store.last_position()
        async with following(store, after=3) as middle, following(store, after=last) as tail:
            await middle.wait_for(2, timeout=self.timeout)
            assert middle.positions() == [4, 5]
            await store.append(s, happened(2, start=5))
            await middle.wait_for(4, timeout=self.timeout)
            await tail.wait_for(2, timeout=self.timeout)
        assert middle.positions() == [4, 5, 6, 7]
        assert tail.positions() == [6, 7]
        assert _versions(tail.records) == [6, 7]

    async def test_subscribe_on_an_empty_store_waits_for_the_first_event(
        self, store: Store
    ) -> None:
        """A subscriber started before anything was stored gets the first event."""
        async with following(store) as follower:
            s = _stream()
            await store.append(s, happened(1))
            await follower.wait_for(1, timeout=self.timeout)
        assert follower.positions() == [1]
        assert follower.records[0].stream_id == s

    async def test_two_subscribers_see_the_same_order(self, store: Store) -> None:
        """Subscribers started at different times deliver the same records in one order."""
        streams = [_stream() for _ in range(3)]
        await store.append(streams[0], happened(2))
        async with following(store) as early:
            for i in range(6):
                await store.append(streams[i % 3], happened(i % 2 + 1))
            async with following(store) as late:
                await store.append(streams[1], happened(1))
                total = await store.last_position()
                await early.wait_for(total, timeout=self.timeout)
                await late.wait_for(total, timeout=self.timeout)
        assert early.records == late.records
        assert early.positions() == list(range(1, total + 1))

    async def test_subscriber_sees_appends_from_another_connection(
        self, store_factory: StoreFactory
    ) -> None:
        """A subscriber on one store follows events appended through another store on the
        same backend (another process)."""
        reader, writer = await store_factory(), await store_factory()
        s = _stream()
        await writer.append(s, happened(1))
        async with following(reader) as follower:
            await follower.wait_for(1, timeout=self.timeout)
            await writer.append(s, happened(2, start=1))
            await follower.wait_for(3, timeout=self.timeout)
        assert follower.positions() == [1, 2, 3]
        assert _versions(follower.records) == [1, 2, 3]

    async def test_cancelling_a_subscriber_stops_it_cleanly(self, store: Store) -> None:
        """Cancelling the task iterating ``subscribe`` ends it promptly, whether it is
        waiting for events or not, and releases what it held: many cancelled subscribers
        later, the store still appends, reads and serves new subscribers."""
        s = _stream()
        await store.append(s, happened(1))
        for _ in range(20):
            follower = Follower(store, 0)
            task = asyncio.create_task(follower.run())
            follower.task = task
            await follower.wait_for(1, timeout=self.timeout)  # now waiting for more
            task.cancel()
            [outcome] = await asyncio.wait_for(
                asyncio.gather(task, return_exceptions=True), self.timeout
            )
            assert isinstance(outcome, asyncio.CancelledError)
            assert task.cancelled()
        async with asyncio.timeout(self.timeout):
            await store.append(s, happened(1, start=1))
            assert len(await read_stream(store, s)) == 2
            async with following(store) as follower:
                await follower.wait_for(2, timeout=self.timeout)
        assert follower.positions() == [1, 2]

    async def test_breaking_out_of_subscribe_and_closing_it(self, store: Store) -> None:
        """A consumer may stop iterating and close the iterator (``aclose``) when done."""
        s = _stream()
        await store.append(s, happened(3))
        iterator = store.subscribe(after=1)
        got: list[RecordedEvent] = []
        async with asyncio.timeout(self.timeout):
            async for rec in iterator:
                got.append(rec)
                if len(got) == 2:
                    break
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
        assert [rec.position for rec in got] == [2, 3]

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

    # -- checkpoints -------------------------------------------------------------------------

    async def test_checkpoints_get_set_list_delete(self, store: Store) -> None:
        """Unknown names are at 0; set overwrites; list shows all; delete forgets."""
        cps = store.checkpoints
        a, b = unique_name("cp"), unique_name("cp")
        assert await cps.get(a) == 0
        await cps.set(a, 5)
        await cps.set(b, 2)
        assert await cps.get(a) == 5
        await cps.set(a, 9)
        assert await cps.get(a) == 9
        listed = await cps.list()
        assert {k: listed[k] for k in (a, b)} == {a: 9, b: 2}
        await cps.delete(a)
        assert await cps.get(a) == 0
        assert a not in await cps.list()
        assert await cps.get(b) == 2
        await cps.delete(unique_name("cp"))  # unknown: no error

    async def test_checkpoint_in_a_committed_transaction_is_set(self, store: Store) -> None:
        """A checkpoint written with ``tx`` is there once the block exits normally."""
        name = unique_name("cp")
        await store.checkpoints.set(name, 3)
        async with store.transaction() as tx:
            await store.checkpoints.set(name, 7, tx=tx)
        assert await store.checkpoints.get(name) == 7
        async with store.transaction() as tx:
            await store.checkpoints.delete(name, tx=tx)
        assert await store.checkpoints.get(name) == 0

    async def test_checkpoint_in_a_rolled_back_transaction_is_unchanged(self, store: Store) -> None:
        """An exception inside the block rolls back the checkpoint's set and delete."""
        name, fresh = unique_name("cp"), unique_name("cp")
        await store.checkpoints.set(name, 3)

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.checkpoints.set(name, 7, tx=tx)
                await store.checkpoints.set(fresh, 1, tx=tx)
                raise Boom
        assert await store.checkpoints.get(name) == 3
        assert await store.checkpoints.get(fresh) == 0
        assert fresh not in await store.checkpoints.list()

        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.checkpoints.delete(name, tx=tx)
                raise Boom
        assert await store.checkpoints.get(name) == 3

        async with store.transaction() as tx:  # the store is usable after a rollback
            await store.checkpoints.set(name, 4, tx=tx)
        assert await store.checkpoints.get(name) == 4

    async def test_transactions_are_not_visible_before_commit(
        self, store_factory: StoreFactory
    ) -> None:
        """Until the block exits, another connection sees the old checkpoint."""
        store, other = await store_factory(), await store_factory()
        name = unique_name("cp")
        await store.checkpoints.set(name, 1)
        async with store.transaction() as tx:
            await store.checkpoints.set(name, 2, tx=tx)
            assert await other.checkpoints.get(name) == 1
        assert await other.checkpoints.get(name) == 2
        assert await store.checkpoints.get(name) == 2

    # -- outbox ------------------------------------------------------------------------------

    @staticmethod
    def _check_outbox(got: Sequence[OutboxMessage], sent: Sequence[tuple[str, Envelope]]) -> None:
        assert [(m.topic, m.message_id, m.key) for m in got] == [
            (topic, env.id, env.key) for topic, env in sent
        ]
        for message, (_, env) in zip(got, sent, strict=True):
            assert Envelope.from_bytes(message.payload).to_dict() == env.to_dict()
        seqs = [m.seq for m in got]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    async def test_outbox_add_pending_remove(self, store: Store) -> None:
        """Messages are pending in the order added (across adds), until removed."""
        topic = f"{unique_name()}.out"
        sent = [
            (topic, Envelope.create(Happened.event_type, {"n": i}, key=f"k{i % 2}"))
            for i in range(5)
        ]
        await store.outbox.add(sent[:2])
        async with store.transaction() as tx:
            await store.outbox.add(sent[2:4], tx=tx)
        await store.outbox.add(sent[4:])
        pending = await store.outbox.pending()
        self._check_outbox(pending, sent)
        self._check_outbox(await store.outbox.pending(limit=2), sent[:2])

        await store.outbox.remove([pending[0].seq, pending[2].seq])
        self._check_outbox(await store.outbox.pending(), [sent[1], sent[3], sent[4]])
        await store.outbox.remove([m.seq for m in pending])
        assert await store.outbox.pending() == []
        await store.outbox.remove([pending[0].seq])  # already gone: no error

    async def test_outbox_rollback_discards(self, store: Store) -> None:
        """Messages added in a rolled-back transaction never become pending."""
        topic = f"{unique_name()}.out"
        kept = (topic, Envelope.create(Happened.event_type, {"n": 1}))
        lost = (topic, Envelope.create(Happened.event_type, {"n": 2}))

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.outbox.add([lost], tx=tx)
                raise Boom
        assert await store.outbox.pending() == []
        async with store.transaction() as tx:
            await store.outbox.add([kept], tx=tx)
        self._check_outbox(await store.outbox.pending(), [kept])

    # -- transactional inbox (dedup) ---------------------------------------------------------

    async def test_mark_handled_counts_only_once_committed(
        self, store_factory: StoreFactory
    ) -> None:
        """``mark_handled`` in a transaction makes ``dedup.seen`` true only after commit,
        and never if the transaction rolls back."""
        store, other = await store_factory(), await store_factory()
        group, done, undone = unique_name("g"), new_id(), new_id()
        async with store.transaction() as tx:
            await store.mark_handled(group, done, tx)
            assert not await other.dedup.seen(group, done)
        assert await store.dedup.seen(group, done)
        assert await other.dedup.seen(group, done)
        assert not await store.dedup.seen(unique_name("g"), done)  # per group

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.mark_handled(group, undone, tx)
                raise Boom
        assert not await store.dedup.seen(group, undone)
        assert not await other.dedup.seen(group, undone)

    async def test_one_transaction_commits_all_its_writes_together(self, store: Store) -> None:
        """Checkpoint, outbox message and dedup entry in one transaction: all or nothing."""
        name, group = unique_name("cp"), unique_name("g")
        topic = f"{unique_name()}.out"

        class Boom(Exception):
            pass

        first = Envelope.create(Happened.event_type, {"n": 1})
        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.checkpoints.set(name, 1, tx=tx)
                await store.outbox.add([(topic, first)], tx=tx)
                await store.mark_handled(group, first.id, tx)
                raise Boom
        assert await store.checkpoints.get(name) == 0
        assert await store.outbox.pending() == []
        assert not await store.dedup.seen(group, first.id)

        async with store.transaction() as tx:
            await store.checkpoints.set(name, 1, tx=tx)
            await store.outbox.add([(topic, first)], tx=tx)
            await store.mark_handled(group, first.id, tx)
        assert await store.checkpoints.get(name) == 1
        self._check_outbox(await store.outbox.pending(), [(topic, first)])
        assert await store.dedup.seen(group, first.id)

    # -- locks -------------------------------------------------------------------------------

    async def test_lock_makes_a_second_holder_wait(self, store_factory: StoreFactory) -> None:
        """While one holder is inside ``lock(name)``, another (other connection) waits; it
        gets the lock once the first exits. Other names are not blocked."""
        first, second, third = [await store_factory() for _ in range(3)]
        name = unique_name("lock")
        order: list[str] = []
        entered = asyncio.Event()

        async def contender() -> None:
            async with second.lock(name):
                order.append("second in")
                entered.set()

        # leaving the group waits for the contender, which needs the lock released first
        async with asyncio.timeout(self.timeout), asyncio.TaskGroup() as tg, first.lock(name):
            order.append("first in")
            tg.create_task(contender())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entered.wait(), self.quiet_period)
            assert not entered.is_set(), "the lock was held twice"
            async with third.lock(unique_name("lock")):
                order.append("other name")
            order.append("first out")
        assert order == ["first in", "other name", "first out", "second in"]

    async def test_lock_is_released_when_the_block_raises(
        self, store_factory: StoreFactory
    ) -> None:
        """An exception inside ``lock(name)`` releases it."""
        first, second = await store_factory(), await store_factory()
        name = unique_name("lock")

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with first.lock(name):
                raise Boom
        async with asyncio.timeout(self.timeout):
            async with second.lock(name):
                pass
            async with first.lock(name):
                pass

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
