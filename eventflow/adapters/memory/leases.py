"""Leases of the memory store, and the checkpoints fenced by them.

The memory store lives in one process: a lease is held until its holder releases it (it
never expires: its holder's renewals cannot fail, and a holder whose loop does not run
stops every task of the store with it), each holding with the next epoch of its name. A
write fenced by a lease is checked when it is made and again when its transaction commits,
in the commit's one synchronous step, so no takeover can come in between.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from ...errors import ConfigurationError, LeaseLostError
from ...leases import DEFAULT_LEASE_TTL, FENCE_NEEDS_TX, Lease, Wakeups, hold_lease, new_owner
from ...ports import Transaction
from .transactions import TransactionScope

__all__ = ["MemoryCheckpoints", "MemoryLeases"]

_WAIT_POLL = 1.0  # a contender is woken at release; this only bounds each wait


class MemoryLeases:
    """Leases in this process (see the module docstring). A contender waits on an event
    set at release, not on a poll."""

    def __init__(self, scope: TransactionScope, ttl: float = DEFAULT_LEASE_TTL) -> None:
        self.ttl = ttl
        self.owner = f"memory:{new_owner()}"
        self.poll = _WAIT_POLL
        self._scope = scope
        self._held: dict[str, tuple[str, int]] = {}  # name -> (owner, epoch) while held
        self._last: dict[str, tuple[str, int]] = {}  # name -> the latest (owner, epoch)
        self._released = Wakeups()

    def hold(self, name: str) -> AbstractAsyncContextManager[Lease]:
        """Wait for the lease on ``name`` and hold it for the block (see ``Leases``)."""
        return hold_lease(self, name, owner=self.owner, ttl=self.ttl, poll=self.poll)

    async def holder(self, name: str) -> str | None:
        """The owner holding ``name``, or None."""
        held = self._held.get(name)
        return None if held is None else held[0]

    async def fence(self, lease: Lease, tx: Transaction) -> None:
        """Refuse ``tx`` (``LeaseLostError`` now, and at its commit) unless ``lease`` is the
        latest holding of its name; checked now and again at commit (see ``Leases.fence``)."""
        if tx is None:
            raise ConfigurationError(FENCE_NEEDS_TX)
        memory_tx = self._scope.of(tx)
        assert memory_tx is not None  # of() returns the transaction it was given
        try:
            self.check(lease)
        except LeaseLostError as exc:
            memory_tx.doom(exc)
            raise
        memory_tx.guard(lambda: self.check(lease))

    async def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """Take ``name`` if nobody holds it; return its new epoch."""
        if name in self._held:
            return None
        epoch = self._last.get(name, ("", 0))[1] + 1
        self._held[name] = self._last[name] = (owner, epoch)
        return epoch

    async def renew(self, name: str, owner: str, epoch: int, ttl: float) -> bool:
        """True while ``(owner, epoch)`` holds ``name``."""
        return self._held.get(name) == (owner, epoch)

    async def release(self, name: str, owner: str, epoch: int) -> None:
        """Let ``name`` go and wake its contenders."""
        if self._held.get(name) == (owner, epoch):
            del self._held[name]
            self._released.wake(name)

    async def wait(self, name: str, timeout: float) -> None:
        """Return at once if ``name`` is free, else when it is released (or ``timeout``)."""
        if name in self._held:  # no suspension between this check and the waiter's start
            await self._released.wait(name, timeout)

    def check(self, lease: Lease) -> None:
        """Raise ``lease.error()`` unless ``lease`` is the latest holding of its name."""
        if self._last.get(lease.name) != (lease.owner, lease.epoch):
            raise lease.error()


class MemoryCheckpoints:
    """Checkpoints in a dict; writes join the context's transaction (or ``tx``), and those
    made with a lease are fenced by ``leases``."""

    def __init__(self, leases: MemoryLeases, scope: TransactionScope) -> None:
        self._positions: dict[str, int] = {}
        self._leases = leases
        self._scope = scope

    async def get(self, name: str) -> int:
        """0 if never set."""
        return self._positions.get(name, 0)

    async def set(
        self,
        name: str,
        position: int,
        *,
        tx: Transaction | None = None,
        lease: Lease | None = None,
    ) -> None:
        """Set now, or when the transaction commits; with ``lease``, refused unless it still
        holds (when the write is made, and at the commit)."""
        self._write(tx, lease, lambda: self._positions.__setitem__(name, position))

    async def list(self) -> dict[str, int]:
        """Every checkpoint."""
        return dict(self._positions)

    async def delete(
        self, name: str, *, tx: Transaction | None = None, lease: Lease | None = None
    ) -> None:
        """Forget ``name``; fenced like ``set``."""
        self._write(tx, lease, lambda: self._positions.pop(name, None))

    def _write(
        self, tx: Transaction | None, lease: Lease | None, apply: Callable[[], object]
    ) -> None:
        joined = self._scope.of(tx)
        leases = self._leases
        if lease is not None:
            leases.check(lease)
        if joined is None:
            apply()
            return
        if lease is not None:
            joined.guard(lambda: leases.check(lease))
        joined.defer(apply)
