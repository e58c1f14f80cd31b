"""The order saga end to end on a real app (memory broker; memory and SQLite stores)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC
from pathlib import Path

import pytest

from eventflow import App

from .shop import Effects, OrderCancelled, OrderPlaced, OrderSaga, Script, participants

Wait = Callable[..., Awaitable[None]]


@pytest.fixture(params=["memory", "sqlite"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 's.db'}"


async def _status(app: App, key: str) -> str | None:
    saga = await app.sagas.get(OrderSaga, key)
    return None if saga is None else saga.status


async def _until_status(app: App, key: str, status: str, waiter: Wait) -> None:
    last: list[str | None] = [None]

    async def check() -> bool:
        last[0] = await _status(app, key)
        return last[0] == status

    for _ in range(800):
        if await check():
            return
        import asyncio

        await asyncio.sleep(0.01)
    raise AssertionError(f"saga {key} is {last[0]}, not {status}")


async def test_the_order_saga_outcomes(broker_url: str, store_url: str, waiter: Wait) -> None:
    script = Script(reject_stock={"o-rej"}, decline={"o-dec"}, never_ship={"o-late"})
    effects = Effects()
    app = App(
        "orders",
        broker=broker_url,
        store=store_url,
        handlers=participants(script, effects),
        sagas=[OrderSaga],
    )
    async with app:
        for oid in ("o-ok", "o-rej", "o-dec", "o-late"):
            await app.publish(OrderPlaced(order_id=oid), key=oid)
        await app.publish(OrderPlaced(order_id="o-ok"), key="o-ok")  # a second start
        await _until_status(app, "o-ok", "completed", waiter)
        await _until_status(app, "o-rej", "compensated", waiter)
        await _until_status(app, "o-dec", "compensated", waiter)
        await _until_status(app, "o-late", "compensated", waiter)
        ok = await app.sagas.get(OrderSaga, "o-ok")
        assert ok is not None and ok.charge_id == "ch-o-ok"
        kinds = [t.kind for t in ok.history]
        assert kinds[0] == "started" and kinds[-1] in ("completed", "ignored")
        assert sum(1 for t in ok.history if t.kind == "started") == 1
        assert any(t.kind == "ignored" and "second" in t.detail for t in ok.history)
        rows = await app.sagas.list(status="compensated")
        assert {r.key for r in rows} == {"o-rej", "o-dec", "o-late"}
        assert all(r.started.tzinfo is UTC and r.started <= r.updated for r in rows)
        # Plain compensations count as done once issued: wait until the participants
        # handled them before leaving the app.
        await waiter(lambda: len(effects.of("o-late")) == 4 and len(effects.of("o-dec")) == 2)
        late = await app.sagas.get(OrderSaga, "o-late")
        assert late is not None
        sent = [t.step for t in late.history if t.kind == "compensation-sent"]
        assert sent == ["charge", "reserve"]  # newest first: refund, then release

    assert effects.of("o-ok") == ["reserved", "charged", "shipped"]
    assert effects.of("o-rej") == []  # stock rejected: nothing to compensate
    assert effects.of("o-dec") == ["reserved", "released"]  # declined: stock released
    # shipping timed out: refund and release (issued in that order, checked above; plain
    # compensations on different topics may be applied in any order)
    assert effects.of("o-late")[:2] == ["reserved", "charged"]
    assert sorted(effects.of("o-late")[2:]) == ["refunded", "released"]


async def test_abort_from_an_event(broker_url: str, store_url: str, waiter: Wait) -> None:
    script = Script(never_ship={"o-1"})
    effects = Effects()
    app = App(
        "orders",
        broker=broker_url,
        store=store_url,
        handlers=participants(script, effects),
        sagas=[OrderSaga],
    )
    async with app:
        await app.publish(OrderPlaced(order_id="o-1"), key="o-1")

        async def charged() -> bool:
            saga = await app.sagas.get(OrderSaga, "o-1")
            return saga is not None and saga.charge_id is not None

        await waiter(charged)
        await app.publish(OrderCancelled(order_id="o-1"), key="o-1")
        await _until_status(app, "o-1", "compensated", waiter)
        saga = await app.sagas.get(OrderSaga, "o-1")
        assert saga is not None
        assert any(t.kind == "aborted" for t in saga.history)
        await waiter(lambda: len(effects.of("o-1")) == 4)
    assert effects.of("o-1")[:2] == ["reserved", "charged"]
    assert sorted(effects.of("o-1")[2:]) == ["refunded", "released"]
