"""The outbox wakes across instances: a message written to the outbox by an instance that
does not hold the relay lease leaves within milliseconds, not at the holder's 1 s poll.

Each test runs ``HOPS`` sequential hops through ``ctx.transaction()`` on each of two
setups, in alternating rounds: one instance on a store of its own (it holds the relay lease
itself), and an instance whose outbox another instance relays (it holds the lease of their
shared store). Across instances a hop must take at most ``RATIO`` times the median of one
instance (issue 19's criterion; before the fix it took about the holder's 1 s poll).
Another App object on the same store and event loop (memory broker), or another OS process
(NATS), holds the lease; on PostgreSQL and on SQLite.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest

from eventflow import App
from eventflow.testing import unique_name
from eventflow.testing.nats_server import nats_service_url
from eventflow.testing.postgres import isolated_schema, postgres_url

from .hop_app import Hops, RelayProcess, compare, holds_relay

RATIO = 3.0

_KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.service("postgres"))]


@contextlib.asynccontextmanager
async def _store(kind: str) -> AsyncIterator[str]:
    """The URL of a new, empty store of ``kind``."""
    if kind == "postgres":
        async with isolated_schema(postgres_url()) as url:
            yield url
        return
    with tempfile.TemporaryDirectory() as folder:
        yield f"sqlite:///{os.path.join(folder, 'hops.db')}"


def _assert_close(one: float, across: float, where: str) -> None:
    print(f"\n{where}: {one:.2f} ms per hop on one instance, {across:.2f} ms across instances")
    assert across <= RATIO * one, (
        f"{where}: a hop relayed by another instance took {across:.1f} ms (median), "
        f"more than {RATIO:g} times the {one:.1f} ms of one instance"
    )


@pytest.mark.parametrize("kind", _KINDS)
async def test_hops_relayed_by_another_app_on_the_same_store_are_fast(
    kind: str, broker_url: str
) -> None:
    alone, served = Hops(), Hops()
    async with contextlib.AsyncExitStack() as stack:
        own_store = await stack.enter_async_context(_store(kind))
        shared_store = await stack.enter_async_context(_store(kind))
        one = App("fx-hops", broker=broker_url, store=own_store, handlers=[alone.handler()])
        holder = App("fx-relay", broker=broker_url, store=shared_store)
        worker = App("fx-hops", broker=broker_url, store=shared_store, handlers=[served.handler()])
        for app in (one, holder, worker):
            await stack.enter_async_context(app)
        assert await holds_relay(holder)  # it started first: its relay took the free lease
        one_ms, across_ms = await compare((one, alone), (worker, served))
        assert await holds_relay(holder) and not await holds_relay(worker)
        assert worker._relays[0].sent == 0  # every hop left through the holder's relay
    _assert_close(one_ms, across_ms, f"{kind}, two apps in one process")


@pytest.fixture(scope="module")
def nats_base() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.mark.parametrize("kind", _KINDS)
async def test_hops_relayed_by_another_process_are_fast(kind: str, nats_base: str) -> None:
    broker = f"{nats_base}?stream={unique_name('FXHOPS').upper()}"
    alone, served = Hops(), Hops()
    async with contextlib.AsyncExitStack() as stack:
        own_store = await stack.enter_async_context(_store(kind))
        shared_store = await stack.enter_async_context(_store(kind))
        relay = await RelayProcess.start(broker, shared_store)
        stack.push_async_callback(relay.stop)
        one = App("fx-hops", broker=broker, store=own_store, handlers=[alone.handler()])
        worker = App("fx-hops", broker=broker, store=shared_store, handlers=[served.handler()])
        for app in (one, worker):
            await stack.enter_async_context(app)
        assert not await holds_relay(worker)
        one_ms, across_ms = await compare((one, alone), (worker, served))
        assert worker._relays[0].sent == 0  # every hop left through the other process
    _assert_close(one_ms, across_ms, f"{kind}, another OS process (NATS)")
