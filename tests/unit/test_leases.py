"""``hold_lease``: the holding logic every store shares, against a lease table kept in a
dict (the stores' own backends are checked by the store contract suite)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from eventflow.errors import LeaseLostError
from eventflow.leases import Lease, Wakeups, hold_lease, new_owner

Wait = Callable[..., Awaitable[None]]

TTL = 0.6


class Table:
    """A ``LeaseBackend`` over a dict (name -> owner, epoch, expiry), with two faults: a
    store that fails every renewal, and a takeover that bumps the epoch."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, int, float]] = {}
        self.failing = False
        self.renewals = 0

    async def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        await asyncio.sleep(0)
        row = self.rows.get(name)
        if row is not None and row[2] > time.monotonic():
            return None
        epoch = (row[1] if row else 0) + 1
        self.rows[name] = (owner, epoch, time.monotonic() + ttl)
        return epoch

    async def renew(self, name: str, owner: str, epoch: int, ttl: float) -> bool:
        await asyncio.sleep(0)
        self.renewals += 1
        if self.failing:
            raise OSError("the store does not answer")
        row = self.rows.get(name)
        if row is None or row[:2] != (owner, epoch) or row[2] <= time.monotonic():
            return False
        self.rows[name] = (owner, epoch, time.monotonic() + ttl)
        return True

    async def release(self, name: str, owner: str, epoch: int) -> None:
        row = self.rows.get(name)
        if row is not None and row[:2] == (owner, epoch):
            self.rows[name] = (owner, epoch, 0.0)

    async def wait(self, name: str, timeout: float) -> None:
        await asyncio.sleep(timeout)

    def steal(self, name: str) -> None:
        _, epoch, _ = self.rows[name]
        self.rows[name] = ("thief", epoch + 1, time.monotonic() + 60)


async def test_renewals_keep_the_lease_and_release_keeps_its_epoch() -> None:
    table = Table()
    async with hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02) as lease:
        assert (lease.name, lease.epoch, lease.owner, lease.lost) == ("job", 1, "me", None)
        await asyncio.sleep(TTL * 2)  # past ttl: only renewals keep it
        assert lease.lost is None and table.renewals >= 3
    assert table.rows["job"][:2] == ("me", 1)  # released, epoch kept
    async with hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02) as again:
        assert again.epoch == 2


async def test_a_takeover_cancels_the_block_with_lease_lost() -> None:
    table = Table()
    began = time.monotonic()
    with pytest.raises(LeaseLostError, match=r"epoch 1.*another holder") as caught:
        async with hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02) as lease:
            table.steal("job")
            await asyncio.sleep(30)
    assert time.monotonic() - began < TTL  # found at the next renewal, ttl / 3 later
    assert caught.value.epoch == 1 and lease.lost is not None
    assert table.rows["job"][0] == "thief"  # a lost lease is not released


async def test_renewals_failing_for_ttl_lose_the_lease_within_ttl() -> None:
    table = Table()
    with pytest.raises(LeaseLostError, match="not renewed for"):
        async with hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02):
            table.failing = True
            failing_since = time.monotonic()
            await asyncio.sleep(30)
    assert time.monotonic() - failing_since < TTL + 0.3


async def test_a_block_whose_unwinding_raises_still_ends_with_lease_lost() -> None:
    """A task group in the block whose child fails while cancelled ends with an
    ExceptionGroup, not a cancellation: the loss must still come out as LeaseLostError."""

    async def child() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    table = Table()
    with pytest.raises(LeaseLostError) as caught:
        async with (
            hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02),
            asyncio.TaskGroup() as tg,
        ):
            tg.create_task(child())
            await asyncio.sleep(0)
            table.steal("job")
            await asyncio.sleep(30)
    assert isinstance(caught.value.__cause__, BaseExceptionGroup)


async def test_errors_of_the_block_and_outside_cancellation_pass_through(waiter: Wait) -> None:
    table = Table()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02):
            raise Boom
    with pytest.raises(TimeoutError):  # the block's own timeout is not a lost lease
        async with hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(30)

    task = asyncio.create_task(_hold_forever(table))
    # Held first (the earlier blocks left it released): else the release is not tested.
    await waiter(lambda: table.rows["job"][2] > 0.0, what="the lease held by the task")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert table.rows["job"][2] == 0.0  # released on the way out


async def _hold_forever(table: Table) -> None:
    async with hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02):
        await asyncio.sleep(30)


async def test_a_contender_waits_for_the_holder() -> None:
    table = Table()
    order: list[str] = []

    async def contender() -> None:
        async with hold_lease(table, "job", owner="other", ttl=TTL, poll=0.02) as lease:
            order.append(f"other {lease.epoch}")

    async with hold_lease(table, "job", owner="me", ttl=TTL, poll=0.02):
        task = asyncio.create_task(contender())
        await asyncio.sleep(TTL * 1.5)  # renewed meanwhile: the contender keeps waiting
        order.append("me out")
    await asyncio.wait_for(task, 5)
    assert order == ["me out", "other 2"]


def test_owners_differ_and_a_lease_describes_itself() -> None:
    assert new_owner() != new_owner()
    lease = Lease("job", 3, "me")
    assert repr(lease) == "<Lease 'job' epoch=3 held>"
    assert "(epoch 3) was lost" in str(lease.error())


def test_wakeups_wake_waiters_and_keep_no_waiter_past_its_loop() -> None:
    wakeups = Wakeups()

    async def woken() -> float:
        began = time.monotonic()
        waiting = asyncio.create_task(wakeups.wait("job", 30))
        await asyncio.sleep(0)
        wakeups.wake("job")
        await waiting
        return time.monotonic() - began

    assert asyncio.run(woken()) < 1
    asyncio.run(wakeups.wait("job", 0.01))  # times out: nothing stays bound to this loop
    assert asyncio.run(woken()) < 1  # another loop waits on the same name
    assert wakeups._waiting == {}
