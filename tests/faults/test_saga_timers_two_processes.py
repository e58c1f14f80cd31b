"""Two saga processes on one PostgreSQL store and one NATS: every timer fires once, and the
timer lease's holder, paused past the lease (SIGSTOP) while it fires a batch of timers and
then resumed (SIGCONT), fires nothing a second time.

Each of the sagas (``FxTimerSaga`` of ``saga_app.py``) has two timers: a named one,
``remind`` (all due at the same moment, so the holder is in the middle of a batch when it is
paused), whose method sends a reminder, and its step's deadline (nobody answers), which
compensates the step. The participants (in the test's process) record each reminder and
each compensation as a row written inside ``ctx.transaction()``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from eventflow import App, open_store
from eventflow.events import EventRegistry
from eventflow.sagas.runtime import Sagas
from eventflow.testing.broker_contract import eventually
from eventflow.testing.nats_server import nats_service_url

from .saga_app import (
    FxHoldPlaced,
    FxTimerSaga,
    SagaProcess,
    connect,
    effects_schema,
    ended,
    nats_saga_url,
    participants,
    saga_schema,
)

pytestmark = [pytest.mark.service("postgres"), pytest.mark.slow]

SAGAS = 60
LEASE_TTL = 1.0
PAUSE = 3.0  # well past the lease: the other process takes the timers over meanwhile
TIMER_LEASE = "eventflow:saga-timers:fxtimer"


@pytest.fixture(scope="module")
def nats_base() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture
def broker_url(nats_base: str) -> str:
    return nats_saga_url(nats_base, "FXTIMER")


@pytest.fixture
async def saga_store_url() -> AsyncIterator[str]:
    """The store both saga processes share, with a short lease TTL."""
    async with saga_schema(LEASE_TTL) as url:
        yield url


@pytest.fixture
async def effects_store_url() -> AsyncIterator[str]:
    """The participants' store, with their effects table."""
    async with effects_schema() as url:
        yield url


async def fired(conn: asyncpg.Connection, kind: str) -> int:
    """Transitions of ``kind`` stored so far."""
    n = await conn.fetchval(
        "SELECT count(*) FROM ef_events WHERE stream_id LIKE 'saga-fxtimer-%' "
        "AND convert_from(envelope, 'UTF8')::jsonb -> 'data' ->> 'kind' = $1",
        kind,
    )
    return int(n)


async def holder(conn: asyncpg.Connection) -> tuple[int, int] | None:
    """(pid, epoch) of the timer lease's live holder, if one holds it."""
    row = await conn.fetchrow(
        "SELECT owner, epoch FROM ef_leases WHERE name = $1 AND expires_at > now()", TIMER_LEASE
    )
    if row is None:
        return None
    return int(row["owner"].split(":")[-2]), int(row["epoch"])


async def _held(conn: asyncpg.Connection) -> bool:
    return await holder(conn) is not None


@pytest.mark.timeout(120)
async def test_two_saga_processes_fire_every_timer_once_and_a_paused_holder_nothing_twice(
    broker_url: str, saga_store_url: str, effects_store_url: str
) -> None:
    saga_db = await connect(saga_store_url)
    fx_db = await connect(effects_store_url)
    procs = [
        await SagaProcess.start(broker_url, saga_store_url, "timer"),
        await SagaProcess.start(broker_url, saga_store_url, "timer"),
    ]
    by_pid = {p.proc.pid: p for p in procs}
    keys = [f"h-{i:03d}" for i in range(SAGAS)]
    try:
        async with App(
            "fx-holder", broker=broker_url, store=effects_store_url, handlers=participants()
        ) as shop:
            remind_at = time.time() + 4.0  # every reminder due at once: one batch to fire
            for key in keys:
                await shop.publish(
                    FxHoldPlaced(hold_id=key, remind_in=remind_at - time.time()), key=key
                )

            async def started() -> bool:
                n = await saga_db.fetchval(
                    "SELECT count(*) FROM ef_saga_timers WHERE timer = 'remind'"
                )
                return int(n) == SAGAS

            await eventually(started, timeout=30, message="every saga started")
            # A live holder (under load a renewal can come late and the lease lapse a moment).
            await eventually(
                lambda: _held(saga_db), timeout=30, message="a process holds the timer lease"
            )
            found = await holder(saga_db)
            assert found is not None and found[0] in by_pid, found
            paused_pid, epoch = found

            async def firing() -> bool:
                return await fired(saga_db, "timer-fired") > 0

            await eventually(firing, timeout=30, interval=0.002, message="the reminders fire")
            by_pid[paused_pid].signal(signal.SIGSTOP)  # in the middle of its batch
            try:
                at_pause = await fired(saga_db, "timer-fired")
                await asyncio.sleep(PAUSE)

                taker: list[tuple[int, int]] = []

                async def taken_over() -> bool:
                    now_held = await holder(saga_db)
                    if now_held is not None and now_held[0] != paused_pid:
                        taker.append(now_held)
                    return bool(taker)

                # The other process took the lease over (a newer epoch) and fired the rest. Read
                # while the paused one is still stopped; as above, under load the live holder's
                # renewal can come late and its lease lapse a moment, so it is waited for.
                await eventually(taken_over, timeout=15, message="the other process holds it")
                assert taker[0][1] > epoch, taker
            finally:
                by_pid[paused_pid].signal(signal.SIGCONT)
            assert at_pause < SAGAS, "the pause came after the batch: nothing to show"

            async def all_compensated() -> bool:
                return await ended(saga_db, keys)

            await eventually(all_compensated, timeout=40, message="every saga timed out")

            async def effects_settled() -> bool:
                n = await fx_db.fetchval("SELECT count(*) FROM fx_effects")
                return int(n) >= 2 * SAGAS

            await eventually(effects_settled, timeout=20, message="the reminders and undos")
            await asyncio.sleep(2 * LEASE_TTL)  # the resumed process had time to misbehave
            for proc in procs:
                await proc.stop()

        async with open_store(saga_store_url) as store:
            sagas = Sagas(store, EventRegistry(), "fx-test")
            for key in keys:
                saga = await sagas.get(FxTimerSaga, key)
                assert saga is not None, key
                assert saga.status == "compensated", (key, saga.status, saga.reason)
                history = [(t.kind, t.step, t.detail) for t in saga.history]
                # Each timer fired once: the reminder and the step's deadline.
                assert [h for h in history if h[0] == "timer-fired"] == [
                    ("timer-fired", None, "remind")
                ], history
                assert [h[:2] for h in history if h[0] == "timed-out"] == [("timed-out", "hold")]
                # ... and no stale firing reached the history (a timer fired again is recorded
                # as ignored: "fired after it was cancelled or rescheduled").
                assert not [h for h in history if h[0] == "ignored" and "timer" in h[2]], history
            rows = await fx_db.fetch(
                "SELECT entity, what, count(*) AS n FROM fx_effects GROUP BY entity, what"
            )
            assert {(r["entity"], r["what"]): r["n"] for r in rows} == {
                **{(k, "reminded"): 1 for k in keys},
                **{(k, "unheld"): 1 for k in keys},
            }
        print("timer lease:", json.dumps({"paused": paused_pid, "epoch_before": epoch}))
    finally:
        for proc in procs:
            proc.signal(signal.SIGCONT)
            await proc.kill()
        await saga_db.close()
        await fx_db.close()
