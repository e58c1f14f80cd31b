"""The store contract's lease tests: ``store.leases`` (one holder at a time, a new epoch per
holding) and fenced writes, for every store; and the lease-loss cases of the SQL stores.

:class:`LeaseContract` runs on every store. :class:`LeaseLossContract` (SQL stores: leases
shared by processes) needs a ``lease_faults`` fixture from the adapter's test module, a
:class:`LeaseFaults` that knows how to break the adapter: make stores with a short ttl,
block a lease's renewals, start a holder in another process. :class:`ConnectionLossContract`
is for stores on a server connection (PostgreSQL): it also kills the holder's connections.

The property every case checks: at no moment do two holders both believe they hold a lease
(when the second enters, the first already knows it lost it, or has released it), and a
write made with the epoch of a lost lease is refused by the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import orjson
import pytest

from ...envelope import Envelope
from ...errors import LeaseLostError, StoreError
from ...leases import Lease
from ...ports import Store
from ..broker_contract import unique_name
from .lease_holder import MODES
from .support import Happened, StoreContractBase, StoreFactory

__all__ = [
    "ConnectionFaults",
    "ConnectionLossContract",
    "LeaseContract",
    "LeaseFaults",
    "LeaseLossContract",
    "LeaseWatch",
]

LEASE_TTL = 1.5
"""The ttl of the stores the lease-loss cases use (short, so that each case is quick)."""


class LeaseContract(StoreContractBase):
    """One holder at a time, epochs that only go up, ``holder()``, fenced writes."""

    async def test_a_second_holder_waits_for_the_first(self, store_factory: StoreFactory) -> None:
        """While one holder is inside ``hold(name)``, another (other connection) waits; it
        gets the lease once the first exits. Other names are not blocked."""
        first, second, third = [await store_factory() for _ in range(3)]
        name = unique_name("lease")
        order: list[str] = []
        entered = asyncio.Event()

        async def contender() -> None:
            async with second.leases.hold(name):
                order.append("second in")
                entered.set()

        # leaving the group waits for the contender, which needs the lease released first
        async with (
            asyncio.timeout(self.timeout),
            asyncio.TaskGroup() as tg,
            first.leases.hold(name),
        ):
            order.append("first in")
            tg.create_task(contender())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entered.wait(), self.quiet_period)
            assert not entered.is_set(), "the lease was held twice"
            async with third.leases.hold(unique_name("lease")):
                order.append("other name")
            order.append("first out")
        assert order == ["first in", "other name", "first out", "second in"]

    async def test_a_lease_is_released_when_the_block_raises(
        self, store_factory: StoreFactory
    ) -> None:
        """An exception inside ``hold(name)`` releases it (and is not a lost lease)."""
        first, second = await store_factory(), await store_factory()
        name = unique_name("lease")

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with first.leases.hold(name):
                raise Boom
        async with asyncio.timeout(self.timeout):
            async with second.leases.hold(name):
                pass
            async with first.leases.hold(name):
                pass

    async def test_each_holding_has_a_higher_epoch_and_holder_names_it(
        self, store_factory: StoreFactory
    ) -> None:
        """Epochs go up with every holding, whoever holds; ``holder()`` is the owner while
        it holds and None once it is released."""
        first, second = await store_factory(), await store_factory()
        name = unique_name("lease")
        assert await first.leases.holder(name) is None
        epochs = []
        async with asyncio.timeout(self.timeout):
            for store in (first, second, first, first):
                async with store.leases.hold(name) as lease:
                    assert lease.name == name and lease.lost is None
                    assert await first.leases.holder(name) == lease.owner
                    assert await second.leases.holder(name) == lease.owner
                    epochs.append(lease.epoch)
                assert await second.leases.holder(name) is None
        assert epochs == sorted(set(epochs)), epochs
        assert first.leases.ttl > 0

    async def test_writes_with_a_stale_epoch_are_refused(self, store_factory: StoreFactory) -> None:
        """Checkpoint set and delete, alone or in a transaction, and outbox removal, made
        with a lease whose name was taken again since: ``LeaseLostError``, nothing written.
        With the current holder's lease they are written."""
        first, second = await store_factory(), await store_factory()
        name, cp = unique_name("lease"), unique_name("cp")
        topic = f"{unique_name()}.out"
        await first.outbox.add([(topic, Envelope.create(Happened.event_type, {"n": 1}))])
        [message] = await first.outbox.pending()
        async with asyncio.timeout(self.timeout):
            async with first.leases.hold(name) as stale:
                await first.checkpoints.set(cp, 1, lease=stale)
            async with second.leases.hold(name) as current:
                await _refused(first.checkpoints.set(cp, 2, lease=stale), stale)
                await _refused(first.checkpoints.delete(cp, lease=stale), stale)
                await _refused(first.outbox.remove([message.seq], lease=stale), stale)
                with pytest.raises(LeaseLostError):
                    async with first.transaction() as tx:
                        await first.checkpoints.set(cp, 3, tx=tx, lease=stale)
                with pytest.raises(LeaseLostError):
                    async with first.transaction() as tx:
                        await first.checkpoints.delete(cp, tx=tx, lease=stale)
                assert await second.checkpoints.get(cp) == 1
                assert [m.seq for m in await second.outbox.pending()] == [message.seq]

                async with second.transaction() as tx:
                    await second.checkpoints.set(cp, 4, tx=tx, lease=current)
                assert await first.checkpoints.get(cp) == 4
                await second.checkpoints.delete(cp, lease=current)
                assert await first.checkpoints.get(cp) == 0
                await second.outbox.remove([message.seq], lease=current)
                assert await first.outbox.pending() == []

    async def test_a_refused_write_rolls_back_its_transaction(
        self, store_factory: StoreFactory
    ) -> None:
        """A stale holder's batch (other writes, then its fenced checkpoint) commits none of
        its writes."""
        first, second = await store_factory(), await store_factory()
        name, cp = unique_name("lease"), unique_name("cp")
        topic = f"{unique_name()}.out"
        async with asyncio.timeout(self.timeout):
            async with first.leases.hold(name) as stale:
                pass
            async with second.leases.hold(name):
                with pytest.raises(LeaseLostError):
                    async with first.transaction() as tx:
                        env = Envelope.create(Happened.event_type, {"n": 1})
                        await first.outbox.add([(topic, env)], tx=tx)
                        await first.checkpoints.set(cp, 5, tx=tx, lease=stale)
        assert await second.outbox.pending() == []
        assert await second.checkpoints.get(cp) == 0


async def _refused(write: Any, lease: Lease) -> None:
    with pytest.raises(LeaseLostError) as caught:
        await write
    assert caught.value.name == lease.name and caught.value.epoch == lease.epoch


# -- lease loss ------------------------------------------------------------------------------


class LeaseFaults(Protocol):
    """What an adapter's test module provides (as the ``lease_faults`` fixture) for the
    lease-loss cases: it knows how to make the adapter's stores and how to break them."""

    async def store(self, *, ttl: float) -> Store:
        """An opened store on the test's backend whose leases have ``ttl``; closed by the
        fixture after the test. Each call is another store instance (another process)."""

    def block_renewals(self, name: str) -> AbstractAsyncContextManager[None]:
        """While inside, nobody can change the lease row of ``name``: its holder's renewals
        fail or hang (another connection holds a lock), and so do takeovers."""

    def child_source(self, *, ttl: float) -> str:
        """Python code defining ``make_store()``, run in a child process: an unopened store
        on the test's backend whose leases have ``ttl``."""


class LeaseWatch:
    """Records who holds a lease as each holder sees it, and fails when two believe they
    hold it at once."""

    def __init__(self) -> None:
        self.believers: dict[str, Lease] = {}

    def entered(self, who: str, lease: Lease) -> None:
        """``who`` entered its block with ``lease``: every other holder must know it lost."""
        others = {w: e for w, e in self.believers.items() if e.lost is None and w != who}
        assert not others, f"{who} holds {lease} while {others} still believe they hold it"
        self.believers[who] = lease

    def left(self, who: str) -> None:
        """``who`` left its block."""
        self.believers.pop(who, None)


@contextlib.asynccontextmanager
async def _contender(
    store: Store, name: str, watch: LeaseWatch, who: str
) -> AsyncIterator[asyncio.Future[Lease]]:
    """Wait for ``name`` from ``store`` in a task for the block, trying again after a store
    failure (as a supervisor restarts its component); the future is the lease once it holds
    it (held until the block exits), or the error if two believed they held it."""
    got: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()

    async def hold() -> None:
        while True:
            try:
                async with store.leases.hold(name) as lease:
                    try:
                        watch.entered(who, lease)
                    except AssertionError as exc:
                        got.set_exception(exc)
                        return
                    got.set_result(lease)
                    try:
                        await asyncio.Future()
                    finally:
                        watch.left(who)
            except StoreError as exc:
                if isinstance(exc, LeaseLostError):
                    if not got.done():
                        got.set_exception(exc)
                    return
                await asyncio.sleep(0.05)

    task = asyncio.create_task(hold(), name=f"lease-contender:{who}")
    try:
        yield got
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not got.done():
            got.cancel()


class LeaseLossContract(StoreContractBase):
    """A holder whose renewals fail, a holder paused past its ttl, a holder killed: the
    lease changes hands within about ttl, never to two believers at once, and the former
    holder's writes are refused. Needs the ``lease_faults`` fixture (:class:`LeaseFaults`).
    """

    lease_ttl: float = LEASE_TTL
    """The ttl of the stores these cases use."""
    write_interval: float = 0.2
    """Seconds between two writes of the child holder."""

    async def test_a_holder_whose_renewals_fail_loses_the_lease_within_ttl(
        self, lease_faults: LeaseFaults
    ) -> None:
        """Renewals blocked for longer than ttl: the holder's block is cancelled and ends
        with ``LeaseLostError`` within about ttl; then another holder enters with a higher
        epoch, and a write with the old epoch is refused."""
        ttl = self.lease_ttl
        first, second = await lease_faults.store(ttl=ttl), await lease_faults.store(ttl=ttl)
        name, cp = unique_name("lease"), unique_name("cp")
        watch = LeaseWatch()
        held = asyncio.get_running_loop().create_future()

        async def hold_first() -> None:
            async with first.leases.hold(name) as lease:
                watch.entered("first", lease)
                held.set_result(lease)
                await asyncio.sleep(self.timeout * 10)

        holding = asyncio.create_task(hold_first())
        stale: Lease = await asyncio.wait_for(held, self.timeout)
        await first.checkpoints.set(cp, 1, lease=stale)
        async with _contender(second, name, watch, "second") as contender:
            async with lease_faults.block_renewals(name):
                blocked_at = time.monotonic()
                with pytest.raises(LeaseLostError, match=f"epoch {stale.epoch}"):
                    await asyncio.wait_for(holding, ttl * 3)
                lost_after = time.monotonic() - blocked_at
                assert stale.lost is not None
            # the bound: no renewal succeeded since (at most ttl / 3) before the block
            assert lost_after < ttl + 1.0, f"lost after {lost_after:.2f}s (ttl {ttl}s)"
            current = await asyncio.wait_for(contender, ttl + self.timeout)
            assert current.epoch > stale.epoch
            await _refused(first.checkpoints.set(cp, 2, lease=stale), stale)
            await second.checkpoints.set(cp, 3, lease=current)
            assert await first.checkpoints.get(cp) == 3

    @pytest.mark.parametrize("mode", MODES)
    async def test_a_holder_paused_past_its_ttl_cannot_write(
        self, lease_faults: LeaseFaults, mode: str
    ) -> None:
        """A holder process stopped (SIGSTOP) for longer than ttl: the lease is taken over
        with a higher epoch; once it runs again (SIGCONT) its next write is refused, it
        reports the loss, and the newer holder's write stays. ``mode``: the holder writes
        with the lease (``write``) or in transactions fenced by it (``fence``: the fenced
        transaction is refused and writes nothing)."""
        ttl = self.lease_ttl
        store = await lease_faults.store(ttl=ttl)
        name, cp = unique_name("lease"), unique_name("cp")
        source = lease_faults.child_source(ttl=ttl)
        async with _child(source, name, cp, self.write_interval, mode) as child:
            held = await child.next("held", self.timeout)
            assert await store.leases.holder(name) == held["owner"]
            async with contextlib.AsyncExitStack() as stack:
                lease = None
                for _ in range(3):  # a stop inside the child's transaction: try again
                    await child.next("wrote", self.timeout, skip=("error", "wrote"))
                    child.pause()
                    await child.drain(0.2)  # what it wrote before it stopped
                    try:
                        async with asyncio.timeout(ttl * 2 + 2):
                            lease = await stack.enter_async_context(store.leases.hold(name))
                        break
                    except (TimeoutError, StoreError):
                        child.resume()
                        held = await child.next("held", ttl + self.timeout, skip=_ANY)
                assert lease is not None, "the lease could not be taken from a stopped holder"
                assert lease.epoch > held["epoch"]
                await store.checkpoints.set(cp, 1_000_000, lease=lease)
                child.resume()
                lost = await child.next("lost", self.timeout)  # nothing written before it
                assert lost["epoch"] == held["epoch"]
                assert (await child.next("refused", self.timeout))["epoch"] == held["epoch"]
                assert await store.checkpoints.get(cp) == 1_000_000
                assert await store.leases.holder(name) == lease.owner
                assert lease.lost is None
                await child.quiet(self.quiet_period)  # it waits: no "held" while this holds
            again = await child.next("held", ttl + self.timeout)  # released: its turn
            assert again["epoch"] > lease.epoch

    async def test_a_killed_holder_is_taken_over_after_ttl(self, lease_faults: LeaseFaults) -> None:
        """A holder process killed (SIGKILL, so it releases nothing): another process takes
        the lease within about ttl, with a higher epoch; a write with the dead holder's
        epoch is refused."""
        ttl = self.lease_ttl
        store = await lease_faults.store(ttl=ttl)
        name, cp = unique_name("lease"), unique_name("cp")
        source = lease_faults.child_source(ttl=ttl)
        async with _child(source, name, cp, self.write_interval) as child:
            held = await child.next("held", self.timeout)
            await child.next("wrote", self.timeout)
            await child.kill()
            killed_at = time.monotonic()
            async with asyncio.timeout(ttl + self.timeout), store.leases.hold(name) as lease:
                taken_after = time.monotonic() - killed_at
                assert lease.epoch > held["epoch"]
                dead = Lease(name, held["epoch"], held["owner"])
                await _refused(store.checkpoints.set(cp, -1, lease=dead), dead)
                await store.checkpoints.set(cp, 7, lease=lease)
        assert taken_after < ttl + 1.0, f"taken over after {taken_after:.2f}s (ttl {ttl}s)"
        assert await store.checkpoints.get(cp) == 7


class ConnectionFaults(LeaseFaults, Protocol):
    """:class:`LeaseFaults` of a store on a server connection."""

    async def kill_connections(self, store: Store) -> int:
        """Have the server end every session of ``store`` (its pool, its listener); return
        how many it ended."""


class ConnectionLossContract(StoreContractBase):
    """A lease outlives the holder's connections: killing them (the server ends every
    session of the holder's store) neither lets a second holder in nor loses the lease
    silently. Needs a ``lease_faults`` fixture that is a :class:`ConnectionFaults`."""

    lease_ttl: float = LEASE_TTL

    async def test_killing_the_holders_connections_lets_no_second_holder_in(
        self, lease_faults: ConnectionFaults
    ) -> None:
        """Every connection of the holder's store killed, three times, while another store
        contends: the holder keeps its lease through reconnects (its fenced writes get
        through), the contender enters only after its release, with a higher epoch, and a
        write with the old epoch is refused."""
        ttl = self.lease_ttl
        first, second = await lease_faults.store(ttl=ttl), await lease_faults.store(ttl=ttl)
        name, cp = unique_name("lease"), unique_name("cp")
        watch = LeaseWatch()
        async with contextlib.AsyncExitStack() as stack:
            async with first.leases.hold(name) as stale:
                watch.entered("first", stale)
                contender = await stack.enter_async_context(
                    _contender(second, name, watch, "second")
                )
                for n in range(1, 4):
                    assert await lease_faults.kill_connections(first) >= 1
                    await asyncio.sleep(ttl / 2)
                    await _eventually_written(first, cp, n, stale, self.timeout)
                assert stale.lost is None, f"the lease was lost: {stale.lost}"
                assert not contender.done(), "a second holder entered"
                watch.left("first")
            current = await asyncio.wait_for(contender, self.timeout)
            assert current.epoch > stale.epoch
            await _refused(first.checkpoints.set(cp, -1, lease=stale), stale)
            assert await second.checkpoints.get(cp) == 3


async def _eventually_written(store: Store, cp: str, n: int, lease: Lease, timeout: float) -> None:
    """Write ``cp = n`` under ``lease``, trying again while the store reconnects."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await store.checkpoints.set(cp, n, lease=lease)
            return
        except LeaseLostError:
            raise
        except StoreError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


# -- the child holder --------------------------------------------------------------------------

_ANY = ("error", "wrote", "lost", "refused", "stale-written")


class _Child:
    """A :mod:`lease_holder` process and the events it reports."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.seen: list[dict[str, Any]] = []

    async def next(
        self, event: str, timeout: float, *, skip: tuple[str, ...] = ("error",)
    ) -> dict[str, Any]:
        """The next report of ``event``; reports of the events in ``skip`` before it are
        passed over, any other fails the test."""
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = await self.process.stdout.readline()
                if not line:
                    raise AssertionError(f"the holder process ended; it reported {self.seen}")
                report: dict[str, Any] = orjson.loads(line)
                self.seen.append(report)
                if report["event"] == event:
                    return report
                if report["event"] not in skip:
                    raise AssertionError(
                        f"expected {event!r}, the holder reported {report} (so far: {self.seen})"
                    )

    async def quiet(self, period: float) -> None:
        """Check the child reports nothing for ``period`` seconds."""
        assert self.process.stdout is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(period):
                line = await self.process.stdout.readline()
                raise AssertionError(f"the holder reported {line!r} while another held")

    async def drain(self, period: float) -> None:
        """Read the reports already written, until none comes for ``period`` seconds (the
        process is paused): they must be writes."""
        assert self.process.stdout is not None
        with contextlib.suppress(TimeoutError):
            while True:
                async with asyncio.timeout(period):
                    line = await self.process.stdout.readline()
                report = orjson.loads(line)
                self.seen.append(report)
                assert report["event"] in ("wrote", "error"), report

    def pause(self) -> None:
        """SIGSTOP: the process stops where it is, its event loop with it."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        os.kill(self.process.pid, signal.SIGCONT)

    async def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        self.process.kill()
        await self.process.wait()


@contextlib.asynccontextmanager
async def _child(
    source: str, name: str, cp: str, interval: float, mode: str = "write"
) -> AsyncIterator[_Child]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "eventflow.testing.store_contract.lease_holder",
        source,
        name,
        cp,
        str(interval),
        mode,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        yield _Child(process)
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            await process.wait()
