"""The saga process killed again and again, on NATS JetStream and PostgreSQL.

100 orders of mixed outcomes (completed; payment declined: stock released; no stock:
nothing to compensate; shipping times out: the refund, a compensation with a reply, then the
stock released) run while the saga process is SIGKILLed at 20 seeded random points and
started again. The participants run in the test's process on a store of their own and apply
each effect in ``ctx.transaction()`` (``saga_app.py``). Afterwards every saga is in its
expected status, every effect happened exactly once, and the history shows compensations
issued newest first, the one with a reply answered before the next was issued. Then the
saga process is killed while named timers wait and kept down past their due time: they fire
once the process is back, once.

The orders that get shipped have a long shipping deadline and the ones that never do a
short one (two saga classes, one definition). The last test here holds a reply in the
partition of a killed member past a short deadline: the overdue timer waits until the
group's lag on the broker is 0 messages (``Broker.lag``), so the reply still wins.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from eventflow import App, Saga, open_store
from eventflow.events import EventRegistry
from eventflow.sagas.control import WAIT_ROW
from eventflow.sagas.runtime import Sagas
from eventflow.testing.broker_contract import eventually, unique_name
from eventflow.testing.nats_server import nats_service_url

from .saga_app import (
    FxHoldPlaced,
    FxLatePlaced,
    FxLateSaga,
    FxOrderPlaced,
    FxOrderSaga,
    FxQuickPlaced,
    FxTimerSaga,
    SagaProcess,
    ShippingGate,
    connect,
    effects_schema,
    ended,
    nats_saga_url,
    participants,
    saga_schema,
    transitions,
)

pytestmark = [pytest.mark.service("postgres"), pytest.mark.slow]

SEED = 1414
ORDERS = 100
KILLS = 20
LEASE_TTL = 1.0  # a killed process's leases (timers, outbox relay) pass on within a second
EXPECTED = {
    "ok": ("completed", ["reserved", "charged", "shipped"]),
    "declined": ("compensated", ["reserved", "released"]),
    "rejected": ("compensated", []),
    "late": ("compensated", ["reserved", "charged", "refunded", "released"]),
}
SAGA_NAMES = "order,late,timer"
TRANSITIONS = {"ok": 8, "declined": 8, "rejected": 5, "late": 12}
"""Transitions each kind of order stores (the kill points are counts of them)."""


@pytest.fixture(scope="module")
def nats_base() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture
def broker_url(nats_base: str) -> str:
    return nats_saga_url(nats_base, "FXSAGA")


@pytest.fixture
async def saga_store_url() -> AsyncIterator[str]:
    """The saga process's store."""
    async with saga_schema(LEASE_TTL) as url:
        yield url


@pytest.fixture
async def effects_store_url() -> AsyncIterator[str]:
    """The participants' store, with their effects table."""
    async with effects_schema() as url:
        yield url


@pytest.mark.timeout(240)
async def test_the_saga_process_killed_20_times_ends_every_saga_right_with_effects_once(
    broker_url: str, saga_store_url: str, effects_store_url: str
) -> None:
    rng = random.Random(SEED)
    kinds = [
        k
        for k, n in (("ok", 40), ("declined", 20), ("rejected", 20), ("late", 20))
        for _ in range(n)
    ]
    rng.shuffle(kinds)
    orders = {f"o-{i:03d}-{kind}": kind for i, kind in enumerate(kinds)}
    saga_db = await connect(saga_store_url)
    fx_db = await connect(effects_store_url)
    procs: list[SagaProcess] = []
    try:
        procs.append(await SagaProcess.start(broker_url, saga_store_url, SAGA_NAMES))
        async with App(
            "fx-participants", broker=broker_url, store=effects_store_url, handlers=participants()
        ) as shop:

            async def feed() -> None:
                for oid, kind in orders.items():
                    start = FxLatePlaced if kind == "late" else FxOrderPlaced
                    await shop.publish(start(order_id=oid), key=oid)
                    await asyncio.sleep(0.1)

            feeding = asyncio.create_task(feed())
            try:
                # The kill points: seeded random counts of stored transitions, so every kill
                # lands while sagas are in flight (handlers, the relay, timers).
                total = sum(TRANSITIONS[kind] for kind in kinds)
                points = sorted(rng.sample(range(10, total - 40), KILLS))
                for point in points:
                    at_start = await transitions(saga_db)

                    async def reached(point: int = point, at_start: int = at_start) -> bool:
                        done = await transitions(saga_db)
                        return done >= point and done > at_start  # ... and this process works

                    await eventually(reached, timeout=60, interval=0.005, message="progress")
                    await procs[-1].kill()
                    procs.append(await SagaProcess.start(broker_url, saga_store_url, SAGA_NAMES))
            finally:
                await feeding

            async def all_ended() -> bool:
                return await ended(saga_db, list(orders))

            await eventually(all_ended, timeout=90, message="every saga completed or compensated")

            # A timer due while the saga process is down fires after the restart, once.
            holds = [f"h-{i}" for i in range(5)]
            for key in holds:
                await shop.publish(FxHoldPlaced(hold_id=key, remind_in=1.0), key=key)

            async def reminders_set() -> bool:
                n = await saga_db.fetchval(
                    "SELECT count(*) FROM ef_saga_timers WHERE timer = 'remind'"
                )
                return int(n) == len(holds)

            await eventually(reminders_set, timeout=30, message="the reminders are set")
            await procs[-1].kill()
            due = float(
                await saga_db.fetchval("SELECT max(due) FROM ef_saga_timers WHERE timer = 'remind'")
            )
            await asyncio.sleep(max(0.0, due - time.time()) + 0.5)
            assert await reminders_set()  # due while no saga process runs: none fired
            procs.append(await SagaProcess.start(broker_url, saga_store_url, SAGA_NAMES))

            async def holds_ended() -> bool:
                return await ended(saga_db, holds)  # the reminder, then the step's deadline

            await eventually(holds_ended, timeout=60, message="the overdue timers fired")
            await procs[-1].stop()

            async def effects_settled() -> bool:
                expected = sum(len(EXPECTED[kind][1]) for kind in orders.values())
                expected += 2 * len(holds)  # reminded, unheld
                return int(await fx_db.fetchval("SELECT count(*) FROM fx_effects")) >= expected

            await eventually(effects_settled, timeout=30, message="the last compensations")

        async with open_store(saga_store_url) as store:
            sagas = Sagas(store, EventRegistry(), "fx-test")
            wrong = []
            latencies = []  # from each step's command to its reply, under the kills
            for oid, kind in orders.items():
                status, effects = EXPECTED[kind]
                saga = await sagas.get(FxLateSaga if kind == "late" else FxOrderSaga, oid)
                assert saga is not None, oid
                rows = await fx_db.fetch(
                    "SELECT what, at FROM fx_effects WHERE entity = $1 ORDER BY seq", oid
                )
                # The expected status; each effect exactly once, in the order the saga issued
                # them (the refund, a compensation with a reply, before the stock release).
                if saga.status != status or [r["what"] for r in rows] != effects:
                    wrong.append(_explain(saga, rows))
                    continue
                _check_history(oid, kind, [(t.kind, t.step) for t in saga.history])
                sent = {t.step: t.at for t in saga.history if t.kind == "command-sent"}
                latencies += [
                    (t.at - sent[t.step]).total_seconds()
                    for t in saga.history
                    if t.kind in ("replied", "rejected")
                ]
            assert not wrong, f"{len(wrong)} sagas went wrong:\n" + "\n".join(wrong[:5])
            latencies.sort()
            print(
                f"reply latency under the kills: p50 {latencies[len(latencies) // 2]:.2f}s, "
                f"max {latencies[-1]:.2f}s over {len(latencies)} steps"
            )
            for key in holds:
                hold = await sagas.get(FxTimerSaga, key)
                assert hold is not None and hold.status == "compensated", key
                fired = [t.detail for t in hold.history if t.kind == "timer-fired"]
                assert fired == ["remind"], hold.history  # once, after the restart
                assert hold.history[-1].at.timestamp() > due
            counts = await fx_db.fetch(
                "SELECT what, count(*) AS n FROM fx_effects WHERE entity = ANY($1::text[]) "
                "GROUP BY what",
                holds,
            )
            assert {r["what"]: r["n"] for r in counts} == {"reminded": 5, "unheld": 5}
        # The kills did leave messages unfinished: the saga processes counted redeliveries
        # (the killed ones' last heartbeats stay behind).
        beats = await saga_db.fetch("SELECT stats::text FROM ef_heartbeats")
        assert sum(json.loads(row[0]).get("redelivered", 0) for row in beats) > 0
        dead = await fx_db.fetchval("SELECT count(*) FROM ef_dead_letters")
        dead += await saga_db.fetchval("SELECT count(*) FROM ef_dead_letters")
        assert dead == 0
    finally:
        for proc in procs:
            await proc.kill()
        await saga_db.close()
        await fx_db.close()


def _explain(saga: Saga, effects: list[asyncpg.Record]) -> str:
    """A saga's history and effects with their times, for a failed assertion."""
    lines = [f"{saga.id}: {saga.status} ({saga.reason})"]
    lines += [f"  {t.at.timestamp():.3f} {t.kind} {t.step} {t.detail}" for t in saga.history]
    lines += [f"  effect {r['at'].timestamp():.3f} {r['what']}" for r in effects]
    return "\n".join(lines)


def _check_history(oid: str, kind: str, history: list[tuple[str, str | None]]) -> None:
    """Each transition once (a re-run after a kill stored nothing twice), and compensations
    newest first, the refund answered before the release was issued."""
    real = [h for h in history if h[0] != "ignored"]
    assert len(real) == len(set(real)), (oid, history)
    assert real[0] == ("started", None), (oid, history)
    sent = [s for k, s in real if k == "command-sent"]
    undo = [(k, s) for k, s in real if k in ("compensation-sent", "compensated")]
    if kind == "ok":
        assert sent == ["reserve", "charge", "ship"] and real[-1][0] == "completed", history
    elif kind == "declined":
        assert sent == ["reserve", "charge"] and ("rejected", "charge") in real, history
        assert undo == [("compensation-sent", "reserve"), ("compensated", None)], history
    elif kind == "rejected":
        assert sent == ["reserve"] and ("rejected", "reserve") in real, history
        assert undo == [("compensated", None)], history
    else:
        assert sent == ["reserve", "charge", "ship"], history
        assert [h for h in real if h[0] == "timed-out"] == [("timed-out", "ship")], history
        assert undo == [
            ("compensation-sent", "charge"),
            ("compensated", "charge"),  # the refund's reply, before the next is issued
            ("compensation-sent", "reserve"),
            ("compensated", None),
        ], history


@pytest.mark.timeout(90)
async def test_a_reply_in_a_killed_members_partition_before_the_deadline_wins(
    nats_base: str, saga_store_url: str, effects_store_url: str
) -> None:
    # The killed member's partitions stay claimed for 8 s: well past the step's deadline.
    stream = unique_name("FXHELD").upper()
    broker_url = f"{nats_base}?stream={stream}&ack_wait=1&lease_ttl=8&heartbeat_interval=0.25"
    saga_db = await connect(saga_store_url)
    fx_db = await connect(effects_store_url)
    procs = [await SagaProcess.start(broker_url, saga_store_url, "quick")]
    gate = ShippingGate()
    try:
        async with App(
            "fx-participants",
            broker=broker_url,
            store=effects_store_url,
            handlers=participants(gate),
        ):
            async with App("fx-client", broker=broker_url) as client:
                await client.publish(FxQuickPlaced(order_id="q-1"), key="q-1")
            await asyncio.wait_for(gate.arrived.wait(), 30)
            await procs[-1].kill()
            gate.opened.set()  # shipped, and the reply sent, while the saga process is down

            async def shipped() -> bool:
                n = await fx_db.fetchval("SELECT count(*) FROM fx_effects WHERE what = 'shipped'")
                return int(n) == 1

            await eventually(shipped, timeout=10, message="the order shipped")
            # The saga waits on its ship step: its one deadline row (WAIT_ROW) is that step's.
            due = float(
                await saga_db.fetchval(
                    "SELECT due FROM ef_saga_timers WHERE timer = $1 AND token LIKE $2",
                    WAIT_ROW,
                    "%:step:ship",
                )
            )
            at = await fx_db.fetchval("SELECT at FROM fx_effects WHERE what = 'shipped'")
            assert at.timestamp() < due - 0.3  # the reply was out well before the deadline
            await asyncio.sleep(max(0.0, due - time.time()) + 0.2)
            procs.append(await SagaProcess.start(broker_url, saga_store_url, "quick"))

            async def decided() -> bool:
                status = await saga_db.fetchval("SELECT status FROM ef_sagas WHERE key = 'q-1'")
                return status in ("completed", "compensated")

            await eventually(decided, timeout=40, message="the saga ends")
            status = await saga_db.fetchval("SELECT status FROM ef_sagas WHERE key = 'q-1'")
            assert status == "completed"
    finally:
        for proc in procs:
            await proc.kill()
        await saga_db.close()
        await fx_db.close()
