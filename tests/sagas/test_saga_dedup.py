"""A saga's handling finds a duplicate where it writes the message's dedup entry, inside its
transaction (``HandlerSpec.dedup_at_commit``): no dedup check before it, and a copy rolls
back whole (no transition, not even an "ignored" one) and is acked as a duplicate. On every
setup (``saga_setup``); with a dedup store apart from the store the check stays."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from eventflow import App, Context, Envelope, Event, Saga, step, subscribe
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.store import MemoryDedupStore
from eventflow.envelope import new_id
from eventflow.headers import SEND_ID_HEADER

from .conftest import Setup

Wait = Callable[..., Awaitable[None]]
TIMEOUT = 30.0
GROUP = "saga.sagadedup"


class DdPlaced(Event, type="sagadedup.placed"):
    order_id: str


class DdReserve(Event, type="sagadedup.reserve"):
    order_id: str


class DdReserved(Event, type="sagadedup.reserved"):
    order_id: str


class DedupSaga(Saga, name="sagadedup", start=DdPlaced, key="order_id"):
    """Start, one step, completed."""

    order_id: str = ""

    def started(self, e: DdPlaced) -> None:
        self.order_id = e.order_id

    @step(reply=DdReserved, timeout=300.0)
    def reserve(self) -> Event:
        return DdReserve(order_id=self.order_id)


def participant(group: str, replies: list[Envelope], commands: list[str]) -> Any:
    """Answers each reserve command, keeping the reply's envelope."""

    @subscribe("sagadedup.reserve", group=group)
    async def reserve(cmd: DdReserve, ctx: Context) -> None:
        commands.append(cmd.order_id)
        replies.append(await ctx.publish(DdReserved(order_id=cmd.order_id)))

    return reserve


class SeenCalls:
    """Counts ``seen`` calls per group on a dedup store class (patched for the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
        self.groups: list[str] = []
        original = cls.seen

        async def seen(store: Any, group: str, message_id: str) -> bool:
            self.groups.append(group)
            result: bool = await original(store, group, message_id)
            return result

        monkeypatch.setattr(cls, "seen", seen)

    def of(self, group: str) -> int:
        return self.groups.count(group)


async def resend(app: App, env: Envelope) -> None:
    """Send a copy of ``env`` as a new broker message (past NATS's duplicate window, as a
    dead-letter replay does): a duplicate only the consumer's dedup can drop."""
    headers = {SEND_ID_HEADER: new_id()}
    await app.broker.publish(env.type, env.to_bytes(), key=env.key, headers=headers)


async def _completed(app: App, waiter: Wait) -> Any:
    async def done() -> bool:
        saga = await app.sagas.get(DedupSaga, "o-1")
        return saga is not None and saga.status == "completed"

    await waiter(done, timeout=TIMEOUT, what="the saga completed")
    return await app.sagas.get(DedupSaga, "o-1")


async def test_a_duplicate_saga_input_is_applied_once_without_a_dedup_check(
    saga_setup: Setup, waiter: Wait, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start event and a reply, each delivered twice: each applied once (one "started",
    one "replied", nothing "ignored"), the copies acked as duplicates, and no ``seen`` call
    for the saga's group (the participant's group still checks first)."""
    replies: list[Envelope] = []
    commands: list[str] = []
    group = f"{saga_setup.groups}.stock"
    app = saga_setup.app(
        "sagadedup", handlers=[participant(group, replies, commands)], sagas=[DedupSaga]
    )
    async with app:
        assert app.dedup is app.store.dedup
        calls = SeenCalls(monkeypatch, type(app.dedup))
        placed = await app.publish(DdPlaced(order_id="o-1"), key="o-1")
        first = await _completed(app, waiter)
        await resend(app, placed)
        await resend(app, replies[0])

        def outcomes(pattern: str) -> tuple[int, int]:
            s = app.stats()[f"{GROUP}:{pattern}"]
            return s["handled"], s["duplicates"]

        await waiter(
            lambda: (
                outcomes("sagadedup.placed") == (1, 1) and outcomes("sagadedup.reserved") == (1, 1)
            ),
            timeout=TIMEOUT,
            what="each copy acked as a duplicate",
        )
        saga = await app.sagas.get(DedupSaga, "o-1")
    assert saga is not None and saga.history == first.history
    kinds = [t.kind for t in saga.history]
    assert kinds.count("started") == 1 and kinds.count("replied") == 1, kinds
    assert "ignored" not in kinds, kinds
    assert commands == ["o-1"]
    assert calls.of(GROUP) == 0
    assert calls.of(group) >= 1  # the counter counts: the participant checks first


@pytest.mark.service("nats")
@pytest.mark.parametrize("saga_setup", ["nats-postgres"], indirect=True)
async def test_on_postgresql_the_dedup_entry_rides_on_the_saga_append(
    saga_setup: Setup, waiter: Wait, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL the saga's dedup entry is written by its append's statement: the
    consumer's ``mark_handled`` of it then finds it written in the transaction (and sends
    nothing), and a handling that guessed its saga is that statement alone; a copy of an
    input fails that statement, rolls back whole and is acked as a duplicate."""
    from eventflow.adapters.postgres import PostgresStore
    from eventflow.adapters.postgres.db import PostgresDatabase

    ridden: list[bool] = []  # per mark_handled of the saga's group: found written
    original = PostgresStore.mark_handled

    async def mark_handled(store: Any, group: str, message_id: str, tx: Any, **kw: Any) -> None:
        if group == GROUP:
            ridden.append(store.db.marked(tx, group, message_id))
        await original(store, group, message_id, tx, **kw)

    monkeypatch.setattr(PostgresStore, "mark_handled", mark_handled)
    alone: list[None] = []  # handlings committed by their one statement (no BEGIN, COMMIT)
    ended_alone = PostgresDatabase.ended_alone

    def count_alone(db: PostgresDatabase) -> None:
        alone.append(None)
        ended_alone(db)

    monkeypatch.setattr(PostgresDatabase, "ended_alone", count_alone)
    replies: list[Envelope] = []
    commands: list[str] = []
    group = f"{saga_setup.groups}.stock"
    app = saga_setup.app(
        "sagadedup", handlers=[participant(group, replies, commands)], sagas=[DedupSaga]
    )
    async with app:
        placed = await app.publish(DdPlaced(order_id="o-1"), key="o-1")
        first = await _completed(app, waiter)
        await resend(app, placed)
        await resend(app, replies[0])
        await waiter(
            lambda: all(
                app.stats()[f"{GROUP}:{p}"]["duplicates"] == 1
                for p in ("sagadedup.placed", "sagadedup.reserved")
            ),
            timeout=TIMEOUT,
            what="each copy acked as a duplicate",
        )
        saga = await app.sagas.get(DedupSaga, "o-1")
    assert saga is not None and saga.history == first.history
    assert commands == ["o-1"]
    assert ridden == [True, True]  # the two handled inputs; the copies rolled back before
    # Both guessed their saga (a start: none; the reply: as committed), so each handling
    # was its append's statement alone; the copies' conflicts were not committed.
    assert len(alone) == 2


async def test_a_dedup_store_apart_from_the_store_is_checked_first(
    broker_url: str, hub: MemoryBroker, waiter: Wait, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``dedup=`` apart from the store (Redis, here a memory one) the saga's dedup
    entry in the transaction is not the one the app keeps, so the check before stays."""
    replies: list[Envelope] = []
    commands: list[str] = []
    calls = SeenCalls(monkeypatch, MemoryDedupStore)
    app = App(
        "sagadedup",
        broker=broker_url,
        store="memory://",
        dedup=MemoryDedupStore(),
        handlers=[participant("stock", replies, commands)],
        sagas=[DedupSaga],
    )
    async with app:
        assert app.dedup is not app.store.dedup
        placed = await app.publish(DdPlaced(order_id="o-1"), key="o-1")
        await _completed(app, waiter)
        await resend(app, placed)
        await waiter(
            lambda: app.stats()[f"{GROUP}:sagadedup.placed"]["duplicates"] == 1,
            timeout=TIMEOUT,
            what="the copy acked as a duplicate",
        )
    assert calls.of(GROUP) >= 2
