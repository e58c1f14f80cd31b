"""A reply held by a killed member of the saga's group, on Kafka (Tansu) + PostgreSQL.

DESIGN section 5: a reply that reached the broker before the step's deadline wins over the
timeout, whatever the app was doing at the deadline, a member of the saga's group killed
while holding the reply included, on Kafka too. Here the saga's app runs all along; a second
process joins the saga's group on the reply topic (``saga_reply_holder.py``), takes its
share of the replies and stalls, is SIGKILLed past the deadlines, and the group gives its
partitions (offsets uncommitted) to the app: every saga whose participant answered
completes, and a control saga in the same run, whose participant never answers, is
compensated (the deadline does fire).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from eventflow import App, Context, Event, Saga, step, subscribe
from eventflow.testing.broker_contract import eventually, unique_name
from eventflow.testing.kafka_server import fast_test_url, kafka_service_url
from eventflow.testing.postgres import isolated_schema, postgres_url

from .children import Child, launch

pytestmark = [pytest.mark.service("kafka"), pytest.mark.service("postgres")]

HOLDER = Path(__file__).with_name("saga_reply_holder.py")
DEADLINE = 3.0
"""Seconds the saga waits for ``FxPicked``."""


class FxParcel(Event, type="promisefx.parcel.sent"):
    order_id: str


class FxPick(Event, type="promisefx.parcel.pick"):
    order_id: str


class FxPicked(Event, type="promisefx.parcel.picked"):
    order_id: str


class FxUnpick(Event, type="promisefx.parcel.unpick"):
    order_id: str


class FxParcelSaga(Saga, name="promisefx.parcel", start=FxParcel, key="order_id"):
    """Pick (deadline ``DEADLINE``), compensated by ``FxUnpick``."""

    order_id: str = ""

    def started(self, e: FxParcel) -> None:
        self.order_id = e.order_id

    @step(reply=FxPicked, timeout=DEADLINE)
    def pick(self) -> Event:
        return FxPick(order_id=self.order_id)

    @pick.compensate
    def unpick(self) -> Event:
        return FxUnpick(order_id=self.order_id)


def participants(log: list[tuple[str, str]], silent: set[str]) -> list[Any]:
    """Answers ``FxPick`` at once but for the ``silent`` orders; records ``FxUnpick``."""

    @subscribe(FxPick.event_type, group="promisefx.picking", concurrency=8)
    async def pick(cmd: FxPick, ctx: Context) -> None:
        if cmd.order_id in silent:
            log.append(("unanswered", cmd.order_id))
            return
        log.append(("picked", cmd.order_id))
        await ctx.publish(FxPicked(order_id=cmd.order_id))

    @subscribe(FxUnpick.event_type, group="promisefx.picking", concurrency=8)
    async def unpick(cmd: FxUnpick, ctx: Context) -> None:
        log.append(("unpicked", cmd.order_id))

    return [pick, unpick]


@pytest.fixture(scope="module")
def kafka_url() -> Iterator[str]:
    """One Kafka-protocol broker for this module, with test timings (2 s sessions)."""
    with kafka_service_url() as url:
        yield fast_test_url(url)


@pytest.fixture
async def store_url() -> AsyncIterator[str]:
    """A PostgreSQL schema of the test's own."""
    async with isolated_schema(postgres_url()) as url:
        yield url


async def _saga(app: App, key: str) -> Any:
    return await app.sagas.get(FxParcelSaga, key)


@pytest.mark.timeout(180)
async def test_a_reply_held_by_a_killed_kafka_member_before_the_deadline_wins(
    kafka_url: str, store_url: str, tmp_path: Path
) -> None:
    url = f"{kafka_url}&topic_prefix={unique_name('pfx')}."
    log: list[tuple[str, str]] = []
    control = "c-control"
    out = tmp_path / "held"
    group = f"saga.{FxParcelSaga.definition.name}"
    app = App(
        "promisefx-parcels",
        broker=url,
        store=store_url,
        handlers=participants(log, {control}),
        sagas=[FxParcelSaga],
    )
    holder: Child | None = None
    async with app:
        try:
            holder = Child(
                await launch(
                    HOLDER, url, FxPicked.event_type, group, str(out), what="the reply holder"
                )
            )

            def held() -> list[str]:
                return out.read_text().split() if out.exists() else []

            await app.publish(FxParcel(order_id=control), key=control)
            keys: list[str] = []
            for wave in range(10):  # until the holder has a few replies
                for i in range(6):
                    key = f"c-{wave}-{i}"
                    keys.append(key)
                    await app.publish(FxParcel(order_id=key), key=key)

                def answered() -> bool:
                    return sum(1 for what, k in log if what == "picked") == len(keys)

                await eventually(answered, timeout=60, message="the participant answered")
                await asyncio.sleep(0.5)  # for the holder's fetches
                if len(held()) >= 2:
                    break
            taken = set(held())
            assert len(taken) >= 2, f"the holder took {taken}: the test shows nothing"
            dues = []
            for key in taken:
                saga = await _saga(app, key)
                assert saga is not None, key
                sent = next(t.at.timestamp() for t in saga.history if t.kind == "command-sent")
                dues.append(sent + DEADLINE)
            past = max(dues) + 1.0
            await eventually(lambda: time.time() > past, timeout=60, message="past the deadlines")
            await holder.kill()  # holding its replies: the group moves its partitions

            async def ended(key: str) -> Any:
                saga = await _saga(app, key)
                return saga is not None and saga.status in ("completed", "compensated", "failed")

            for key in [*keys, control]:
                await eventually(lambda k=key: ended(k), timeout=60, message=f"{key} ended")
            sagas = {key: await _saga(app, key) for key in keys}
            lost = {
                k: [(t.kind, t.step) for t in s.history]
                for k, s in sagas.items()
                if s.status != "completed"
            }
            assert not lost, f"{len(lost)} of {len(keys)} ({len(taken)} held) lost: {lost}"
            checked = await _saga(app, control)
            assert checked.status == "compensated", checked.history
            assert any(t.kind == "timed-out" for t in checked.history), checked.history
        finally:
            if holder is not None:
                await holder.kill()
    assert all(("unpicked", k) not in log for k in keys), log
