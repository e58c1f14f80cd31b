"""What the store contract's modules share: the test event, the ``store_factory`` type
and :func:`store_pool`, read helpers, the subscriber helper and the base class holding
the waits and the ``store`` fixture."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import pytest

from ...envelope import Envelope
from ...events import Event
from ...ports import EventStore, RecordedEvent, Store
from ..broker_contract import eventually, unique_name

__all__ = [
    "Follower",
    "Happened",
    "StoreContractBase",
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


class StoreContractBase:
    """What every part of :class:`~eventflow.testing.store_contract.StoreContract` uses: the
    waits and the ``store`` fixture (the adapter's test module provides ``store_factory``)."""

    timeout: float = DEFAULT_TIMEOUT
    """Seconds to wait for something that must happen."""
    quiet_period: float = DEFAULT_QUIET_PERIOD
    """Seconds to watch for something that must not happen (a lock taken twice)."""

    @pytest.fixture
    async def store(self, store_factory: StoreFactory) -> Store:
        """An opened store on the test's fresh backend."""
        return await store_factory()
