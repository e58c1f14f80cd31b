"""A temporary group's member: a subscription whose group's consumers go when it closes.

``NatsBroker.subscribe(..., temporary=True)`` creates the group's consumers with an
``inactive_threshold`` (``TEMPORARY_INACTIVE``), so the server removes those of a process
that died, and wraps the member in :class:`TemporarySubscription`, which deletes them once
the member left the group. What ``app.request``'s reply listeners join.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from ...ports import Delivery
from .subscription import NatsSubscription

__all__ = ["TemporarySubscription"]


class TemporarySubscription:
    """``member`` (the group's only one), and ``forget`` (deleting the group's consumers)
    awaited after it closed while connected."""

    def __init__(self, member: NatsSubscription, forget: Callable[[], Awaitable[None]]) -> None:
        self._member = member
        self._forget = forget
        self.pattern = member.pattern
        self.group = member.group

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery]:
        """The member's ``fetch``."""
        return await self._member.fetch(max_messages, timeout)

    async def close(self) -> None:
        """Leave the group, then delete its consumers (if still connected; else the
        server removes them once idle). Idempotent."""
        member = self._member
        if member.closed:
            return
        await member.close()
        if member.nc.is_connected:
            await self._forget()
