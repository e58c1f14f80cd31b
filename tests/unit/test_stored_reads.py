"""Reading stored events: a page of stored envelopes decoded at once (stored_envelopes), and
pages read ahead while the reader reads the current one (sourcing.paging.paged)."""

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from eventflow import Envelope, MalformedMessageError
from eventflow.envelope import stored_envelopes
from eventflow.ports import RecordedEvent
from eventflow.sourcing.paging import paged


def _envelope(n: int) -> Envelope:
    return Envelope.create(
        "test.stored", {"n": n}, key=f"k-{n}", source="tests", headers={"h": "v"}
    )


def test_own_forms_decode_as_from_bytes_does() -> None:
    wire = [_envelope(n).to_bytes() for n in range(5)]
    got = list(stored_envelopes(wire))
    assert [e.to_dict() for e in got] == [Envelope.from_bytes(b).to_dict() for b in wire]
    assert all(e.time.tzinfo is UTC for e in got)


def test_other_forms_are_checked_and_filled_like_from_bytes() -> None:
    # A form an earlier version (or a person) wrote: fields missing, an offset time.
    old = orjson.dumps(
        {"id": "e-1", "type": "test.stored", "time": "2024-01-01T02:00:00+02:00", "data": {}}
    )
    [env] = stored_envelopes([old])
    assert env.correlation_id == "e-1" and env.headers == {} and env.version == 1
    assert env.time == datetime(2024, 1, 1, tzinfo=UTC) and env.time.tzinfo is UTC


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b"[1, 2]",
        orjson.dumps({**orjson.loads(_envelope(1).to_bytes()), "time": "yesterday"}),
        orjson.dumps({"type": "test.stored"}),
    ],
    ids=["not-json", "not-an-object", "bad-time", "no-id"],
)
def test_a_bad_stored_form_raises_what_from_bytes_raises(payload: bytes) -> None:
    with pytest.raises(MalformedMessageError) as expected:
        Envelope.from_bytes(payload)
    with pytest.raises(MalformedMessageError) as got:
        list(stored_envelopes([payload]))
    assert str(got.value) == str(expected.value)


class _Pages:
    """A log of ``n`` rows (position, envelope), fetched a page at a time, with a record of
    the fetches started, finished and cancelled."""

    def __init__(self, n: int) -> None:
        self.rows = [(i, _envelope(i)) for i in range(1, n + 1)]
        self.started: list[int] = []
        self.finished: list[int] = []
        self.cancelled: list[int] = []
        self.blocked: set[int] = set()  # fetches after these cursors wait until cancelled

    async def fetch(self, after: int, size: int) -> list[tuple[int, Envelope]]:
        self.started.append(after)
        try:
            if after in self.blocked:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(after)
            raise
        self.finished.append(after)
        return self.rows[after : after + size]


def _records(rows: Sequence[Any]) -> list[RecordedEvent]:
    return [RecordedEvent("s", pos, pos, env) for pos, env in rows]


@pytest.mark.parametrize("ahead", [None, lambda: True], ids=["page-by-page", "read-ahead"])
@pytest.mark.parametrize(("n", "limit"), [(0, None), (25, None), (30, None), (25, 7), (25, 20)])
async def test_pages_read_ahead_or_not_give_every_row_once_in_order(
    ahead: Any, n: int, limit: int | None
) -> None:
    pages = _Pages(n)
    got = [
        rec.position
        async for rec in paged(pages.fetch, 0, limit, _records, lambda r: r[0], 10, ahead=ahead)
    ]
    assert got == list(range(1, n + 1))[:limit]
    # No page past a short one or the limit is asked for.
    wanted = n if limit is None else min(n, limit)
    assert pages.started == list(range(0, wanted + 1 if limit is None else wanted, 10))


async def test_the_next_page_is_fetched_while_this_one_is_read() -> None:
    pages = _Pages(30)
    reader = paged(pages.fetch, 0, None, _records, lambda r: r[0], 10, ahead=lambda: True)
    first = await anext(reader)
    assert first.position == 1
    assert pages.started == [0, 10]  # page two is under way before page one is read
    await reader.aclose()


async def test_a_reader_that_stops_early_cancels_the_page_read_ahead() -> None:
    pages = _Pages(30)
    pages.blocked.add(10)  # page two's fetch is still waiting when the reader stops
    reader = paged(pages.fetch, 0, None, _records, lambda r: r[0], 10, ahead=lambda: True)
    await anext(reader)
    await reader.aclose()
    assert pages.cancelled == [10]
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_no_read_ahead_when_ahead_says_no() -> None:
    pages = _Pages(30)
    allowed = False
    reader = paged(pages.fetch, 0, None, _records, lambda r: r[0], 10, ahead=lambda: allowed)
    await anext(reader)
    assert pages.started == [0]
    await reader.aclose()
