"""What a member tells, once, while it waits for partitions another member holds.

A member that should own a partition under the current assignment claims its lease; the
claim fails while another member holds it. A live holder hands it over once its messages
are settled; a holder that stopped refreshing its lease (a killed process, a lost machine)
keeps it until the lease expires, ``lease_ttl`` after its last refresh. :class:`Waiting`
reads who holds each such lease and when it was last refreshed (:meth:`.Leases.holder`),
logs once per dead holder which partitions wait for it and in about how many seconds they
move, and says when to claim again: just after those leases expire, not a heartbeat later.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from .config import LEASE_MARGIN, NatsBrokerConfig
from .ledger import Leases

__all__ = ["Waiting", "ranges"]

_log = logging.getLogger("eventflow.nats")
# A lease stored on file expires up to a quarter of a second late (the server's expiry
# timer); claim again just after that.
_EXPIRY_LAG = 0.3


class _Held(NamedTuple):
    """A partition another member holds, as last read."""

    member: str
    expires: float  # the lease, at the latest (loop clock)
    dead: bool  # its holder stopped refreshing it


def ranges(indexes: list[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3, 5"``."""
    runs: list[list[int]] = []
    for i in sorted(indexes):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class Waiting:
    """The partitions one member waits for (see the module docstring)."""

    def __init__(
        self,
        group: str,
        pattern: str,
        config: NatsBrokerConfig,
        leases: Leases,
        alive: Callable[[str], bool],
    ) -> None:
        """``alive`` tells whether a member heartbeated lately (see :mod:`.membership`)."""
        self._group = group
        self._pattern = pattern
        self._leases = leases
        self._ttl = config.effective_lease_ttl
        # A lease older than this was not refreshed on time: its holder stopped.
        self._stale_after = config.keepalive_interval + LEASE_MARGIN
        self._alive = alive
        self._held: dict[int, _Held] = {}  # by partition index
        self._told: set[str] = set()  # dead holders already logged
        self.retry_at = math.inf
        """When (loop clock) a lease waited for expires: claim again then."""

    async def note(self, keys: Mapping[int, str], now: float) -> None:
        """Claims of the partitions in ``keys`` (index -> lease key) failed at ``now``."""
        for index in list(self._held):
            if index not in keys:
                del self._held[index]  # no longer wanted (the assignment changed)
        wall = time.time()
        for index, key in keys.items():
            known = self._held.get(index)
            if known is not None and now < known.expires:
                continue
            holder = await self._leases.holder(key)
            if holder is None:
                self._held.pop(index, None)  # released meanwhile: the next claim takes it
                continue
            age = max(0.0, wall - holder.written_at)
            dead = age > self._stale_after and not self._alive(holder.member)
            self._held[index] = _Held(holder.member, now + max(0.0, self._ttl - age), dead)
        self._forget_told()
        dead_at = [held.expires for held in self._held.values() if held.dead]
        self.retry_at = min(dead_at) + _EXPIRY_LAG if dead_at else math.inf
        by_holder: dict[str, list[int]] = {}
        for index, held in self._held.items():
            if held.dead and held.member not in self._told:
                by_holder.setdefault(held.member, []).append(index)
        for member, indexes in by_holder.items():
            self._told.add(member)
            moves_in = max(self._held[i].expires for i in indexes) - now
            _log.warning(
                "group %s (%s): partitions %s are held by member %s, which stopped "
                "refreshing its leases (killed, or cut off from NATS); they move to this "
                "member in about %.1fs, when its leases expire (lease_ttl %.1fs), its unacked "
                "messages first",
                self._group,
                self._pattern,
                ranges(indexes),
                member,
                moves_in,
                self._ttl,
            )

    def claimed(self, indexes: list[int]) -> None:
        """This member took the partitions ``indexes``; logs those a dead member held."""
        taken: dict[str, list[int]] = {}
        for index in indexes:
            known = self._held.pop(index, None)
            if known is not None and known.dead:
                taken.setdefault(known.member, []).append(index)
        for member, got in taken.items():
            _log.info(
                "group %s (%s): took over partitions %s from member %s",
                self._group,
                self._pattern,
                ranges(got),
                member,
            )
        self._forget_told()
        if not self._held:
            self.retry_at = math.inf

    def _forget_told(self) -> None:
        self._told &= {held.member for held in self._held.values()}
