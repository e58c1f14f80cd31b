"""The batch dedup verdicts of a pipeline (``eventflow.runtime.lookups``): taken once, "seen"
final, "not seen" only while fresh and until the pipeline records the id itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from eventflow.adapters.memory.store import MemoryDedupStore
from eventflow.headers import MESSAGE_ID_HEADER
from eventflow.runtime import lookups
from eventflow.runtime.lookups import Lookups


@dataclass
class _Delivery:
    """What ``Lookups.fetched`` reads of a delivery: its broker headers."""

    headers: dict[str, str] = field(default_factory=dict)


def batch(*ids: str | None) -> list[Any]:
    return [_Delivery({MESSAGE_ID_HEADER: i} if i is not None else {}) for i in ids]


class Counting(MemoryDedupStore):
    """Counts ``seen_many`` calls; ``hold`` makes the next one wait until it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.looked_up: list[list[str]] = []
        self.hold: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def seen_many(self, group: str, message_ids: Sequence[str]) -> set[str]:
        self.looked_up.append(list(message_ids))
        if self.fail is not None:
            raise self.fail
        if self.hold is not None:
            await self.hold.wait()
        return await super().seen_many(group, message_ids)


async def test_verdicts_are_taken_once_and_seen_is_final() -> None:
    clock = [1000.0]
    dedup, found = Counting(), Lookups("g", "g:t", clock=lambda: clock[0])
    await dedup.mark("g", "a")
    await found.fetched(dedup, batch("a", "b", None))  # no header: checked on its own
    assert dedup.looked_up == [["a", "b"]]
    clock[0] += lookups.FRESH + 1  # "not seen" expired, "seen" stands
    assert found.take("a") is True and found.take("b") is None
    assert found.take("a") is None  # once


async def test_a_fresh_not_seen_stands_until_the_pipeline_records_the_id() -> None:
    dedup, found = Counting(), Lookups("g", "g:t")
    await found.fetched(dedup, batch("a", "b", "c"))
    assert found.take("a") is False
    found.forget("b")  # handled here (a copy taken meanwhile): check the next copy itself
    assert found.take("b") is None and found.take("c") is False


async def test_an_id_recorded_while_its_lookup_runs_gets_no_verdict() -> None:
    """The lookup read before the record committed: its "not seen" must not be kept."""
    dedup, found = Counting(), Lookups("g", "g:t")
    dedup.hold = asyncio.Event()
    lookup = asyncio.create_task(found.fetched(dedup, batch("a", "b")))
    await asyncio.sleep(0)
    assert dedup.looked_up == [["a", "b"]]
    await dedup.mark("g", "a")
    found.forget("a")
    dedup.hold.set()
    await lookup
    assert found.take("a") is None and found.take("b") is False


async def test_one_id_is_not_looked_up_and_a_failed_lookup_leaves_no_verdicts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dedup, found = Counting(), Lookups("g", "g:t")
    await found.fetched(dedup, batch("a", None))
    assert dedup.looked_up == [] and found.take("a") is None
    dedup.fail = OSError("store down")
    with caplog.at_level(logging.WARNING, "eventflow.consumer"):
        await found.fetched(dedup, batch("a", "b"))
    assert found.take("a") is None and found.take("b") is None
    assert "checking each message on its own" in caplog.text


async def test_untaken_verdicts_are_dropped_once_expired() -> None:
    """A delivery skipped before its check (a replay for another group) leaves its verdict:
    the next batch drops the expired ones, so they stay within a fetch window."""
    clock = [1000.0]
    dedup, found = Counting(), Lookups("g", "g:t", clock=lambda: clock[0])
    await found.fetched(dedup, batch("a", "b"))
    clock[0] += lookups.FRESH + 1
    await found.fetched(dedup, batch("c", "d"))
    assert set(found._verdicts) == {"c", "d"}
