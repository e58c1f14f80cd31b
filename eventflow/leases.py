"""Leases with fencing tokens: how the stores keep one holder of a name across processes.

``async with store.leases.hold(name) as lease:`` waits until this process holds the lease on
``name``, then keeps it renewed until the block exits. Each time a lease changes hands its
``epoch`` goes up by one; writes made under a lease carry it (``checkpoints.set(...,
lease=lease)``, ``outbox.remove(..., lease=lease)``), or a whole transaction does
(``await store.leases.fence(lease, tx)``), and the store refuses a write or a transaction
whose epoch is no longer the lease's (:class:`~eventflow.errors.LeaseLostError`), so a
holder that was paused or cut off while another took over cannot commit.

The bound: a holder renews every ``ttl / 3``; a renewal counts from the moment it was sent.
Once ``ttl`` has passed since the last renewal that succeeded (the store may have let the
lease expire by then, and another instance may take it over), or as soon as a renewal finds
the epoch changed, the lease is lost: the block is cancelled at its next ``await`` and
ends with ``LeaseLostError``. A holder whose event loop does not run (a paused process) learns
it when it resumes; until then its fenced writes are what keeps the data safe.

This module holds the logic every store shares; a store provides a :class:`LeaseBackend`
(acquire, renew, release, wait) over its own table.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

from ._logging import Throttled
from .errors import LeaseLostError

__all__ = [
    "DEFAULT_LEASE_TTL",
    "FENCE_NEEDS_TX",
    "Lease",
    "LeaseBackend",
    "Wakeups",
    "hold_lease",
    "new_owner",
]

DEFAULT_LEASE_TTL = 10.0
"""Seconds a lease outlives its last renewal."""

FENCE_NEEDS_TX = (
    "leases.fence(lease, tx) fences a transaction: pass the store transaction it guards "
    "(`async with store.transaction() as tx:`)"
)
"""The ``ConfigurationError`` message of a ``fence`` given no transaction."""

_log = logging.getLogger("eventflow.leases")
_throttled = Throttled(_log)


def new_owner() -> str:
    """A lease owner id for one store instance: host, process and a random part, so two
    store instances (in one process or not) never pass for each other."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class Wakeups:
    """Contenders waiting for a lease to be released, by name, for a backend's ``wait``: one
    future per waiting call, made on the loop that waits (so a store used from several event
    loops, one after the other, never keeps a waiter bound to a loop that is gone)."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}

    async def wait(self, name: str, timeout: float) -> None:
        """Return when :meth:`wake` is called for ``name``, or after ``timeout``. The waiter
        is registered before this first suspends, so a wake-up right after the call counts."""
        waiter = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(name, set())
        waiting.add(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            pass
        finally:
            waiting.discard(waiter)
            if not waiting and self._waiting.get(name) is waiting:
                del self._waiting[name]

    def wake(self, name: str) -> None:
        """Wake every contender waiting for ``name``."""
        for waiter in self._waiting.pop(name, ()):
            if not waiter.done():
                waiter.set_result(None)


class Lease:
    """A lease this process holds: ``name``, ``epoch`` (the fencing token), ``owner``.

    ``lost`` is None while it is held, else why it was lost.
    """

    __slots__ = ("_scope", "epoch", "lost", "name", "owner")

    def __init__(self, name: str, epoch: int, owner: str) -> None:
        self.name = name
        self.epoch = epoch
        self.owner = owner
        self.lost: str | None = None
        self._scope: asyncio.Timeout | None = None

    def __repr__(self) -> str:
        state = "held" if self.lost is None else f"lost: {self.lost}"
        return f"<Lease {self.name!r} epoch={self.epoch} {state}>"

    def error(self) -> LeaseLostError:
        """The error a write made with this (stale) lease is refused with."""
        return LeaseLostError(
            self.name, self.epoch, self.lost or "another holder took it over (a newer epoch)"
        )

    def _lose(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = why
        scope = self._scope
        if scope is not None:
            scope.reschedule(asyncio.get_running_loop().time())  # cancel the block now


class LeaseBackend(Protocol):
    """What a store provides for :func:`hold_lease` (durations in seconds)."""

    async def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """Take the lease if it is free or expired: return its new epoch, or None."""

    async def renew(self, name: str, owner: str, epoch: int, ttl: float) -> bool:
        """Extend the lease by ``ttl``; False if ``epoch`` is no longer its epoch or the lease
        expired (a renewal that reaches the store late, after its holder gave up, must not
        keep contenders out for another ``ttl``)."""

    async def release(self, name: str, owner: str, epoch: int) -> None:
        """Let the lease go (keeping its epoch), if ``epoch`` still holds it."""

    async def wait(self, name: str, timeout: float) -> None:
        """Return when the lease may have been released, or after ``timeout``."""


@asynccontextmanager
async def hold_lease(
    backend: LeaseBackend, name: str, *, owner: str, ttl: float, poll: float
) -> AsyncIterator[Lease]:
    """Wait for the lease on ``name`` (trying again every ``poll`` seconds or when woken),
    hold it for the block and release it after; see the module docstring."""
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        epoch = await _acquire(backend, name, owner, ttl)
        if epoch is not None:
            break
        await backend.wait(name, poll)
    lease = Lease(name, epoch, owner)
    keeper = loop.create_task(_keep(backend, lease, ttl, began), name=f"eventflow:lease:{name}")
    try:
        try:
            async with asyncio.timeout(None) as scope:
                lease._scope = scope
                yield lease
        except Exception as exc:
            # The loss cancelled the block: what it ended with is that loss, whether the
            # scope's TimeoutError or an error raised while it unwound (a task group whose
            # child failed on cancellation ends with an ExceptionGroup, not a cancellation).
            if lease.lost is not None and scope.expired():
                raise lease.error() from (None if isinstance(exc, TimeoutError) else exc)
            raise
    finally:
        lease._scope = None
        keeper.cancel()
        # The block often ends by a cancellation (its owner stops it), and a second one can
        # follow (the owner's supervisor closing): the release must still happen, or a
        # stopped app keeps the lease until it expires. It is one bounded statement, so the
        # cleanup waits it out and the cancellation is raised after.
        cleanup = asyncio.ensure_future(_wind_up(backend, lease, keeper))
        cancelled = False
        while not cleanup.done():
            try:
                await asyncio.wait({cleanup})
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError()


async def _wind_up(backend: LeaseBackend, lease: Lease, keeper: asyncio.Task[None]) -> None:
    """Wait for the renewing task to end, then release the lease unless it was lost."""
    await asyncio.wait({keeper})
    if lease.lost is None:
        await _release(backend, lease)


async def _acquire(backend: LeaseBackend, name: str, owner: str, ttl: float) -> int | None:
    # Shielded: a caller cancelled while the statement runs must not leave the lease held
    # until it expires (a contender would wait a whole ttl), so it is released again.
    attempt = asyncio.ensure_future(backend.acquire(name, owner, ttl))
    try:
        return await asyncio.shield(attempt)
    except asyncio.CancelledError:
        epoch = await _settle(attempt)
        if epoch is not None:
            await _release(backend, Lease(name, epoch, owner))
        raise


async def _settle(attempt: asyncio.Future[int | None]) -> int | None:
    """The outcome of ``attempt`` once it ends (None if it failed)."""
    await asyncio.wait({attempt})
    if attempt.cancelled() or attempt.exception() is not None:
        return None
    return attempt.result()


async def _release(backend: LeaseBackend, lease: Lease) -> None:
    try:
        await asyncio.shield(backend.release(lease.name, lease.owner, lease.epoch))
    except Exception as exc:  # it expires after ttl anyway; a contender waits until then
        _log.warning("could not release lease %r (%s); it expires by itself", lease.name, exc)


async def _keep(backend: LeaseBackend, lease: Lease, ttl: float, renewed_at: float) -> None:
    """Renew ``lease`` every ``ttl / 3`` until cancelled; lose it when a renewal finds the
    epoch changed or none succeeded for ``ttl``."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(max(0.0, renewed_at + ttl / 3 - loop.time()))
        deadline = renewed_at + ttl
        while True:
            sent = loop.time()
            remaining = deadline - sent
            if remaining <= 0:
                lease._lose(
                    f"it was not renewed for {ttl:g}s (the store did not answer in time: it "
                    "is down, or busy with a transaction of this process longer than that)"
                )
                return
            try:
                async with asyncio.timeout(remaining):
                    renewed = await backend.renew(lease.name, lease.owner, lease.epoch, ttl)
            except TimeoutError:
                continue  # the deadline passed: lost (above)
            except Exception as exc:  # the store failed: try again until the deadline
                _throttled.warning(
                    f"renew:{lease.name}",
                    "renewing lease %r failed (%s: %s); retrying for %.1fs more",
                    lease.name,
                    type(exc).__name__,
                    exc,
                    remaining,
                )
                await asyncio.sleep(min(ttl / 10, max(0.0, deadline - loop.time())))
                continue
            if not renewed:
                lease._lose("it expired or another holder took it over (its epoch changed)")
                return
            renewed_at = sent
            _throttled.clear(f"renew:{lease.name}")
            break
