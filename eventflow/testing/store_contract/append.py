"""The store contract's append tests: versions, expected versions, ids and idempotent
re-appends, atomic failures and exact round trips."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from ...envelope import Envelope, new_id
from ...errors import ConcurrencyError, ConfigurationError, EventflowError, StoreError
from ...ports import Checkpoints, DedupStore, EventStore, Outbox, Store
from .support import (
    Happened,
    StoreContractBase,
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

__all__ = ["AppendContract"]


class AppendContract(StoreContractBase):
    """Appending: versions, expected versions, ids, idempotent re-appends, round trips."""

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
