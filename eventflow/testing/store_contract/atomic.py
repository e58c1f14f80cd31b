"""The store contract's tests of appends made inside ``store.transaction()``: they commit
with the transaction or not at all, the transaction reads its own appends, readers outside
it see nothing before the commit, and a concurrent writer of the same stream finds the
stream as the transaction left it.

"Outside the transaction" is another store on the backend (another process), read from a
context the transaction is not bound to: on the memory store every store the factory hands
out is the same one, and a call made in the transaction's context would join it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from ...errors import ConcurrencyError
from ...ports import RecordedEvent, Store
from ..broker_contract import unique_name
from .support import (
    StoreContractBase,
    StoreFactory,
    _envelopes,
    _ids,
    _ns,
    _stream,
    _versions,
    following,
    happened,
    read_all,
    read_stream,
)

__all__ = ["TransactionalAppendContract"]

T = TypeVar("T")


class _Boom(Exception):
    pass


def _outside(context: contextvars.Context, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run ``coro`` in a task bound to (a copy of) ``context``, taken before the transaction
    opened: its store calls do not join the transaction."""
    return asyncio.get_running_loop().create_task(coro, context=context.copy())


class TransactionalAppendContract(StoreContractBase):
    """Appends inside ``store.transaction()``: all or nothing, with the transaction."""

    async def test_an_append_in_a_transaction_that_raises_leaves_nothing(
        self, store: Store
    ) -> None:
        """Appends to two streams (one from tasks created inside the block) and a checkpoint,
        then the block raises: no event, no version, no position is left, and the next
        append takes the position right after the last committed one."""
        first, second, cp = _stream(), _stream(), unique_name("cp")
        await store.append(first, happened(1))
        before = await store.last_position()
        with pytest.raises(_Boom):
            async with store.transaction() as tx:
                assert await store.append(first, happened(2, start=1), expected_version=1) == 3
                await asyncio.gather(
                    store.append(second, happened(1)), store.append(second, happened(1))
                )
                await store.checkpoints.set(cp, 7, tx=tx)
                raise _Boom
        assert _ns(await read_stream(store, first)) == [0]
        assert await store.stream_version(first) == 1
        assert await read_stream(store, second) == []
        assert await store.stream_version(second) == 0
        assert await store.last_position() == before
        assert await read_all(store, after=before) == []
        assert await store.checkpoints.get(cp) == 0
        assert await store.append(first, happened(1, start=9), expected_version=1) == 2
        [rec] = await read_all(store, after=before)
        assert (rec.stream_id, rec.stream_version, rec.position) == (first, 2, before + 1)

    async def test_an_append_in_a_committed_transaction_is_seen_after_the_commit(
        self, store_factory: StoreFactory
    ) -> None:
        """Outside the transaction (another store, a subscriber) nothing is seen before the
        block exits; after it every reader sees the events, at consecutive positions, and
        ``subscribe`` delivers them."""
        store, other = await store_factory(), await store_factory()
        s = _stream()
        start = await store.last_position()
        outside = contextvars.copy_context()
        async with following(other, after=start) as follower:
            async with store.transaction():
                assert await store.append(s, happened(3), expected_version=0) == 3
                seen = await _outside(outside, _view(other, s))
                assert seen == ([], 0, start), "an uncommitted append was visible outside"
                await asyncio.sleep(0.05)
                assert follower.records == [], "subscribe delivered an uncommitted append"
            events, version, last = await _view(other, s)
            assert (_ns(events), version, last) == ([0, 1, 2], 3, start + 3)
            await follower.wait_for(3, timeout=self.timeout)
        assert [(r.stream_id, r.position) for r in follower.records] == [
            (s, start + 1),
            (s, start + 2),
            (s, start + 3),
        ]
        assert _versions(await read_stream(store, s)) == [1, 2, 3]

    async def test_the_transaction_reads_its_own_appends(self, store: Store) -> None:
        """Inside the block the stream has the transaction's appends: its version, its
        events (forwards and backwards), expected versions and the ids already appended
        (a re-append is a no-op); a conflict raises and leaves the transaction usable."""
        s = _stream()
        first, second = _envelopes(2, note="own")
        async with store.transaction():
            assert await store.append(s, [first], expected_version=0) == 1
            assert await store.stream_version(s) == 1
            assert _ids(await read_stream(store, s)) == [first.id]
            assert await store.append(s, [second], expected_version=1) == 2
            assert await store.append(s, [first, second], expected_version=0) == 2  # retried
            with pytest.raises(ConcurrencyError) as conflict:
                await store.append(s, happened(1), expected_version=1)
            assert (conflict.value.expected, conflict.value.actual) == (1, 2)
            forwards = await read_stream(store, s)
            assert (_ids(forwards), _versions(forwards)) == ([first.id, second.id], [1, 2])
            [last] = await read_stream(store, s, backwards=True, limit=1)
            assert (last.envelope.id, last.stream_version) == (second.id, 2)
        committed = await read_stream(store, s)
        assert _ids(committed) == [first.id, second.id]
        assert committed[1].position == committed[0].position + 1

    async def test_a_concurrent_writer_of_the_stream_finds_it_as_the_transaction_left_it(
        self, store_factory: StoreFactory
    ) -> None:
        """While a transaction has appended to a stream, other writers of that stream (another
        store, outside the transaction) do not get in before it ends: the one expecting the
        version the transaction started from gets ``ConcurrencyError`` once it committed,
        one appending at any version lands after the transaction's events."""
        store, other = await store_factory(), await store_factory()
        s = _stream()
        outside = contextvars.copy_context()
        async with store.transaction():
            assert await store.append(s, happened(1, note="tx"), expected_version=0) == 1
            expecting = _outside(outside, other.append(s, happened(1), expected_version=0))
            anywhere = _outside(outside, other.append(s, happened(1, note="any")))
            await asyncio.sleep(self.quiet_period)
            assert not expecting.done() and not anywhere.done(), "a writer got in first"
        async with asyncio.timeout(self.timeout):
            with pytest.raises(ConcurrencyError) as conflict:
                await expecting
            assert conflict.value.expected == 0 and conflict.value.actual >= 1
            assert await anywhere == 2
        records = await read_stream(other, s)
        assert [(_note(r), r.stream_version) for r in records] == [("tx", 1), ("any", 2)]


async def _view(store: Store, stream: str) -> tuple[list[RecordedEvent], int, int]:
    """What a reader sees of ``stream``: its events, its version, the last position."""
    return (
        await read_stream(store, stream),
        await store.stream_version(stream),
        (await store.last_position()),
    )


def _note(rec: RecordedEvent) -> str:
    note = rec.envelope.data.get("note")
    assert isinstance(note, str)
    return note
