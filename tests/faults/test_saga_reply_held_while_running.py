"""A reply held by a killed member of the saga's group wins over its deadline while another
saga process runs and fires timers, on NATS JetStream and PostgreSQL.

Two saga processes run the held-reply saga (one step, a 3 s deadline). Once the ship
commands reach the participant, one saga process is SIGKILLed and the participant answers:
the replies in the killed member's partitions stay there until its partition claims expire
(about 4.75 s after the kill, past the deadlines). The process that runs holds its deadlines
until the group's lag on the reply topic shows nothing published before them pending, so
every order completes; a control in the same run, an order whose shipping never answers,
times out and is compensated. The test checks that every reply reached the broker before its
deadline (the participant's effect row is written just before it publishes), so a
compensated order is the runtime's fault, not a reply the loaded machine sent too late.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import pytest

from eventflow import App, open_store
from eventflow.events import default_registry
from eventflow.sagas.control import WAIT_ROW
from eventflow.sagas.runtime import Sagas
from eventflow.testing.broker_contract import eventually
from eventflow.testing.nats_server import nats_service_url

from .saga_app import (
    HELD_REPLY_ACK_WAIT,
    HELD_REPLY_TIMEOUT,
    FxHeldReplyPlaced,
    FxHeldReplySaga,
    SagaProcess,
    ShippingGate,
    connect,
    effects_schema,
    ended,
    nats_saga_url,
    participants,
    saga_schema,
)

pytestmark = [pytest.mark.service("postgres"), pytest.mark.slow]

ORDERS = 12
CONTROL = "q-control-late"  # the participant never answers an order ending in -late


@pytest.fixture(scope="module")
def nats_base() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture
async def saga_store_url() -> AsyncIterator[str]:
    async with saga_schema(1.0) as url:
        yield url


@pytest.fixture
async def effects_store_url() -> AsyncIterator[str]:
    async with effects_schema() as url:
        yield url


@pytest.mark.timeout(120)
async def test_replies_held_by_a_killed_member_win_while_another_process_runs(
    nats_base: str, saga_store_url: str, effects_store_url: str
) -> None:
    broker_url = nats_saga_url(nats_base, "FXRUN", ack_wait=HELD_REPLY_ACK_WAIT)
    keys = [f"q-{n:02d}" for n in range(ORDERS)]
    saga_db = await connect(saga_store_url)
    procs = [
        await SagaProcess.start(broker_url, saga_store_url, "heldreply"),
        await SagaProcess.start(broker_url, saga_store_url, "heldreply"),
    ]
    gate = ShippingGate()
    try:
        async with App(
            "fx-participants",
            broker=broker_url,
            store=effects_store_url,
            handlers=participants(gate),
        ) as shop:
            for key in [*keys, CONTROL]:
                await shop.publish(FxHeldReplyPlaced(order_id=key), key=key)

            async def all_sent() -> bool:
                # One step: its deadline is the saga's one wait row (WAIT_ROW).
                n = await saga_db.fetchval(
                    "SELECT count(*) FROM ef_saga_timers WHERE timer = $1", WAIT_ROW
                )
                return int(n) == ORDERS + 1

            await eventually(all_sent, timeout=30, message="every ship command sent")
            await gate.arrived.wait()
            await procs[0].kill()  # its partitions stay claimed for about 4.75 s
            gate.opened.set()  # the replies go out now, well before the 3 s deadlines

            await eventually(
                lambda: ended(saga_db, [*keys, CONTROL]), timeout=60, message="every saga ends"
            )
        statuses = dict(
            await saga_db.fetch(
                "SELECT key, status FROM ef_sagas WHERE key = ANY($1::text[])", [*keys, CONTROL]
            )
        )
        assert statuses[CONTROL] == "compensated"
        # Each reply stored before its deadline wins; a held one is handled after it.
        in_time = late = 0
        async with open_store(saga_store_url) as store:
            sagas = Sagas(store, default_registry, "test")
            for key in keys:
                history = await sagas.history(f"saga-{FxHeldReplySaga.definition.name}-{key}")
                sent = next(t.at for t in history if t.kind == "command-sent")
                deadline = sent + timedelta(seconds=HELD_REPLY_TIMEOUT)
                if gate.published[key] >= deadline:
                    continue  # published after its deadline: the rule does not cover it
                in_time += 1
                assert statuses[key] == "completed", (key, statuses)
                assert not any(t.kind == "timed-out" for t in history), key
                replied = next(t.at for t in history if t.kind == "replied")
                late += replied > deadline
            control = await sagas.history(f"saga-{FxHeldReplySaga.definition.name}-{CONTROL}")
            assert [t.kind for t in control if t.step == "ship"] == [
                "command-sent",
                "timed-out",
            ]
        assert in_time >= ORDERS // 2, (
            f"only {in_time} of {ORDERS} replies reached the broker before their deadlines "
            f"({HELD_REPLY_TIMEOUT}s): the machine was too slow to test the rule"
        )
        assert late > 0, "no reply was held past its deadline: nothing was tested"
    finally:
        for proc in procs:
            await proc.kill()
        await saga_db.close()
