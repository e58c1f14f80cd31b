"""On SQLite a saga handling's append travels with its ``COMMIT`` (``Writes.checked_at_commit``),
so a wrong guess of the saga shows at the commit, after the handler returned: the pipeline
rolls back and applies the message again at once, in a fresh transaction, without spending
an attempt (no retry, no backoff, nothing towards the dead-letter queue). Another process
moving the saga between two inputs stands for the wrong guess."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from eventflow import App, Envelope, Event, Saga, step
from eventflow.events import EventRegistry, envelope_for
from eventflow.sagas.runtime import Sagas
from eventflow.stores import open_store

Wait = Callable[..., Awaitable[None]]
TIMEOUT = 30.0
GROUP = "saga.sagacommit"


class CcPlaced(Event, type="sagacommit.placed"):
    order_id: str


class CcReserve(Event, type="sagacommit.reserve"):
    order_id: str


class CcReserved(Event, type="sagacommit.reserved"):
    order_id: str


class CommitSaga(Saga, name="sagacommit", start=CcPlaced, key="order_id"):
    """Start, one step nobody answers (the test answers it), completed."""

    order_id: str = ""

    def started(self, e: CcPlaced) -> None:
        self.order_id = e.order_id

    @step(reply=CcReserved, timeout=300.0)
    def reserve(self) -> Event:
        return CcReserve(order_id=self.order_id)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    yield f"sqlite:///{tmp_path / 'commit.db'}"


async def _kinds(app: App) -> list[str]:
    return [t.kind for t in await app.sagas.history(CommitSaga.definition.stream_prefix + "o-1")]


async def _other_process_applies(url: str, event: Event) -> None:
    """A second process on the same file applies ``event`` to the saga (it reads the store)."""
    async with open_store(url) as store:
        sagas = Sagas(store, EventRegistry(), "other")
        env = Envelope.from_bytes(envelope_for(event, source="other", key="o-1").to_bytes())
        async with store.transaction() as tx:
            await sagas.handling.message(tx, CommitSaga, event, env)


async def _start(app: App, waiter: Wait) -> None:
    """Start the saga of o-1 and wait for its command (this app now guesses the saga)."""
    await app.publish(CcPlaced(order_id="o-1"), key="o-1")

    async def started() -> bool:
        return "command-sent" in await _kinds(app)

    await waiter(started, timeout=TIMEOUT, what="the saga sent its command")


def _stats(app: App, event_type: str) -> dict[str, Any]:
    stats: dict[str, Any] = app.stats()[f"{GROUP}:{event_type}"]
    return stats


async def test_a_guess_found_wrong_at_the_commit_is_applied_again_without_an_attempt(
    sqlite_url: str, broker_url: str, waiter: Wait
) -> None:
    app = App("sagacommit", broker=broker_url, store=sqlite_url, sagas=[CommitSaga])
    async with app:
        await _start(app, waiter)
        # Another process completes the saga: this app's guess (waiting on reserve) is old.
        await _other_process_applies(sqlite_url, CcReserved(order_id="o-1"))
        await app.publish(CcReserved(order_id="o-1"), key="o-1")  # a second reply: late

        async def settled() -> bool:
            return _stats(app, CcReserved.event_type)["handled"] == 1

        await waiter(settled, timeout=TIMEOUT, what="the late reply handled")
        stats = _stats(app, CcReserved.event_type)
        kinds = await _kinds(app)
        saga = await app.sagas.get(CommitSaga, "o-1")
    assert stats["applied_again"] == 1  # its commit found the stream moved, then it read it
    assert (stats["failed"], stats["retries"], stats["dead_lettered"]) == (0, 0, 0)
    assert kinds.count("replied") == 1 and kinds.count("ignored") == 1
    assert kinds[-1] == "ignored"
    assert saga is not None and saga.status == "completed"


async def test_a_guess_that_holds_is_not_applied_again(
    sqlite_url: str, broker_url: str, waiter: Wait
) -> None:
    """The usual case: the guess holds, nothing is applied again, the saga completes."""
    app = App("sagacommit", broker=broker_url, store=sqlite_url, sagas=[CommitSaga])
    async with app:
        await _start(app, waiter)
        await app.publish(CcReserved(order_id="o-1"), key="o-1")

        async def completed() -> bool:
            saga = await app.sagas.get(CommitSaga, "o-1")
            return saga is not None and saga.status == "completed"

        await waiter(completed, timeout=TIMEOUT, what="the saga completed")
        again = sum(s["applied_again"] for k, s in app.stats().items() if k.startswith(GROUP))
        kinds = await _kinds(app)
    assert again == 0
    assert "ignored" not in kinds
