"""The store contract's tests of ``store.leases.fence(lease, tx)``: a transaction fenced by
a lease commits only while the lease still has that epoch, on every store. (A holder paused
past its ttl whose fenced transaction is refused: ``LeaseLossContract`` in ``leases.py``.)"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ...envelope import Envelope
from ...errors import ConfigurationError, LeaseLostError
from ...ports import Store
from ..broker_contract import unique_name
from .support import Happened, StoreContractBase, StoreFactory, _stream, happened

__all__ = ["FenceContract"]


class FenceContract(StoreContractBase):
    """``fence``: a stale epoch refuses the whole transaction, the holder's passes."""

    async def test_a_transaction_fenced_by_a_stale_lease_commits_nothing(
        self, store_factory: StoreFactory
    ) -> None:
        """A lease taken again by another holder since: ``fence`` raises ``LeaseLostError``,
        and the transaction's appends, checkpoint and outbox rows, made before or after the
        fence, are not committed, even when the caller swallows the error (leaving the
        block raises it again). The current holder's fenced transaction commits."""
        first, second = await store_factory(), await store_factory()
        name, cp, s = unique_name("lease"), unique_name("cp"), _stream()
        topic = f"{unique_name()}.out"
        async with asyncio.timeout(self.timeout):
            async with first.leases.hold(name) as stale:
                pass
            async with second.leases.hold(name) as current:
                with pytest.raises(LeaseLostError) as refused:
                    async with first.transaction() as tx:
                        await first.append(s, happened(1))
                        await first.checkpoints.set(cp, 1, tx=tx)
                        await first.leases.fence(stale, tx)
                assert (refused.value.name, refused.value.epoch) == (name, stale.epoch)
                with pytest.raises(LeaseLostError):
                    async with first.transaction() as tx:
                        with contextlib.suppress(LeaseLostError):
                            await first.leases.fence(stale, tx)
                        await first.checkpoints.set(cp, 2, tx=tx)
                        env = Envelope.create(Happened.event_type, {"n": 1})
                        await first.outbox.add([(topic, env)], tx=tx)
                await _nothing_written(second, s, cp)
                await _nothing_written(first, s, cp)

                async with second.transaction() as tx:
                    await second.leases.fence(current, tx)
                    await second.append(s, happened(1))
                    await second.checkpoints.set(cp, 3, tx=tx)
                assert await first.stream_version(s) == 1
                assert await first.checkpoints.get(cp) == 3

    async def test_a_fence_needs_a_transaction_of_the_store(self, store: Store) -> None:
        """``fence`` without a transaction is a ``ConfigurationError`` saying what to pass."""
        async with asyncio.timeout(self.timeout), store.leases.hold(unique_name("lease")) as lease:
            with pytest.raises(ConfigurationError, match="transaction"):
                await store.leases.fence(lease, None)  # type: ignore[arg-type]


async def _nothing_written(store: Store, stream: str, cp: str) -> None:
    assert await store.stream_version(stream) == 0
    assert await store.checkpoints.get(cp) == 0
    assert await store.outbox.pending() == []
