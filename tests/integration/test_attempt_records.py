"""A message with an attempt record is acked only once the record is gone.

The broker forgets an acked message: had the record been cleared after the ack, a process
killed between the two would leave it behind for good (it ages out only after the store's
retention). In the other order, a kill between the two leaves a message the broker
redelivers, and its handling (a duplicate by then) clears the record.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from eventflow import App, Context, Event, RetryPolicy, subscribe
from eventflow.adapters.memory import groups as memory_groups


class FxFlaky(Event, type="it.attempts.flaky", version=1):
    """A message whose handler fails once."""

    n: int


async def test_a_retried_message_is_acked_after_its_attempt_record_is_cleared(
    broker_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    waiter: Callable[..., Awaitable[None]],
) -> None:
    database = tmp_path / "store.db"
    records_at_ack: list[int] = []
    ack = memory_groups.MemoryDelivery.ack

    async def counting_ack(self: memory_groups.MemoryDelivery) -> None:
        with sqlite3.connect(database) as conn:
            records_at_ack.append(conn.execute("SELECT count(*) FROM ef_attempts").fetchone()[0])
        await ack(self)

    monkeypatch.setattr(memory_groups.MemoryDelivery, "ack", counting_ack)
    calls: list[int] = []
    records_in_retry: list[int] = []

    @subscribe(
        "it.attempts.flaky",
        group="flaky",
        retry=RetryPolicy(max_attempts=3, initial_delay=0.01),
    )
    async def handle(event: FxFlaky, ctx: Context) -> None:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("the first attempt fails")
        with sqlite3.connect(database) as conn:  # the failure was recorded before the retry
            records_in_retry.append(conn.execute("SELECT count(*) FROM ef_attempts").fetchone()[0])

    app = App("it-attempts", broker=broker_url, store=f"sqlite:///{database}", handlers=[handle])
    async with app:
        await app.publish(FxFlaky(n=1))
        await waiter(lambda: records_at_ack, what="the message was acked")
        assert calls == [1, 2]
    assert records_in_retry == [1]  # the positive control: the record existed
    assert records_at_ack == [0]  # and was gone when the ack went out
