"""A fault for tests of lease holders: a holder that does not know it lost its lease.

A holder learns that its lease is gone from its own renewals (see :mod:`eventflow.leases`).
One whose process is paused, or cut off from the store while its clock says all is well,
keeps working: only the fencing of its writes stops it. :func:`unaware_of_loss` makes such a
holder in one process, so that a test can run it next to a healthy one::

    stale = unaware_of_loss(store)          # the same store, with leases that can stall
    runner = ProjectionRunner(projection, stale.store)
    ...                                     # runner active under stale.store's lease
    stale.stall()                           # its renewals hang; it still believes it holds
    # after the store's ttl another instance takes the lease; the runner's next batch is
    # refused by the fence (LeaseLostError out of run()), and nothing it handled commits

It wraps a store by delegation and changes nothing but how its holder keeps the lease: the
store's own rows, epochs and fenced writes are the real ones.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, cast

from ..leases import Lease, LeaseBackend, hold_lease
from ..ports import Store, Transaction

__all__ = ["BELIEVED_TTL", "StalledLeases", "UnawareHolder", "unaware_of_loss"]

BELIEVED_TTL = 3600.0
"""How long the unaware holder believes its lease lasts without a renewal."""


class _StoreLeases(LeaseBackend, Protocol):
    """What the stores' lease objects are besides the ``Leases`` port."""

    ttl: float
    owner: str
    poll: float

    async def holder(self, name: str) -> str | None:
        """The owner holding ``name``."""

    async def fence(self, lease: Lease, tx: Transaction) -> None:
        """Fence ``tx`` by ``lease``."""


class StalledLeases:
    """``store.leases`` of the wrapped store: the store's own leases, except that once
    :meth:`stall` is called renewals hang (no answer, no error) and the holder believes a
    lease lasts :data:`BELIEVED_TTL` seconds, so it never notices the loss by itself."""

    def __init__(self, leases: Any) -> None:
        self._inner = cast(_StoreLeases, leases)
        self.ttl = self._inner.ttl
        self._stalled = False
        self.renewals = 0

    def stall(self) -> None:
        """From now on, renewals hang."""
        self._stalled = True

    def hold(self, name: str) -> AbstractAsyncContextManager[Lease]:
        """Hold ``name`` through the store's backend, renewed until :meth:`stall`."""
        inner = self._inner
        return hold_lease(self, name, owner=inner.owner, ttl=BELIEVED_TTL, poll=inner.poll)

    async def holder(self, name: str) -> str | None:
        """The store's answer."""
        return await self._inner.holder(name)

    async def fence(self, lease: Lease, tx: Transaction) -> None:
        """The store's fence."""
        await self._inner.fence(lease, tx)

    async def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """Take the lease for the store's ttl (not the believed one)."""
        return await self._inner.acquire(name, owner, self._inner.ttl)

    async def renew(self, name: str, owner: str, epoch: int, ttl: float) -> bool:
        """Renew for the store's ttl, or hang once stalled."""
        if self._stalled:
            await asyncio.Future()  # cancelled when the holder lets go
        self.renewals += 1
        return await self._inner.renew(name, owner, epoch, self._inner.ttl)

    async def release(self, name: str, owner: str, epoch: int) -> None:
        """The store's release."""
        await self._inner.release(name, owner, epoch)

    async def wait(self, name: str, timeout: float) -> None:
        """The store's wait."""
        await self._inner.wait(name, timeout)


class _Delegating:
    """A store that is ``store`` except for its ``leases``."""

    def __init__(self, store: Store, leases: StalledLeases) -> None:
        self._store = store
        self.leases = leases

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class UnawareHolder:
    """What :func:`unaware_of_loss` returns: ``store`` to hand to the holder, ``stall()``."""

    def __init__(self, store: Store) -> None:
        self.leases = StalledLeases(store.leases)
        self.store = cast(Store, _Delegating(store, self.leases))

    def stall(self) -> None:
        """The holder's renewals hang from now on (see :class:`StalledLeases`)."""
        self.leases.stall()


def unaware_of_loss(store: Store) -> UnawareHolder:
    """Wrap ``store`` for a holder that will not notice when its lease is lost (see the
    module docstring)."""
    return UnawareHolder(store)
