"""Who is in a consumer group, and which partitions are this member's.

Members of a group split its partitions between them without a leader: each member
heartbeats on a core-NATS control subject (``<control_prefix>.<group id>``) with its id and
the partitions it is draining, every member computes the same assignment from the sorted
member ids (partition ``p`` goes to member ``p mod n``), and a member that stopped
heartbeating for three intervals (it crashed) is forgotten, so its partitions are assigned
again once their leases expire (see :mod:`.ledger`).
"""

from __future__ import annotations

from collections.abc import Collection

import orjson

__all__ = ["Membership"]


class Membership:
    """The members of one group as this member last heard of them."""

    def __init__(self, member_id: str, partitions: int, now: float) -> None:
        self.member_id = member_id
        self._partitions = partitions
        self._members: dict[str, float] = {member_id: now}  # member -> last heard of
        self._draining: dict[str, set[int]] = {}  # other member -> partitions it gives up

    def desired(self) -> set[int]:
        """The partitions this member should hold under the current assignment."""
        members = sorted(self._members)
        me = members.index(self.member_id)
        n = len(members)
        return {p for p in range(self._partitions) if p % n == me}

    def alive(self, member: str) -> bool:
        """Whether ``member`` heartbeated lately (or is this member)."""
        return member in self._members

    def joined(self, held: Collection[int]) -> bool:
        """Whether every desired partition is ``held`` (and not draining), or still being
        given up by another member."""
        draining = set().union(*self._draining.values()) if self._draining else set()
        return all(p in held or p in draining for p in self.desired())

    def announcement(self, op: str, draining: list[int]) -> bytes:
        """This member's control message: ``op`` is ``join``, ``hb`` or ``leave``."""
        return orjson.dumps({"id": self.member_id, "op": op, "draining": draining})

    def heard(self, body: bytes, now: float) -> bool | None:
        """Take in a control message; ``None`` if it changes nothing (ours, or unreadable),
        else whether to heartbeat at once (a newcomer must learn of us)."""
        try:
            data = orjson.loads(body)
            member, op = str(data["id"]), str(data["op"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None
        if member == self.member_id:
            return None
        if op == "leave":
            self._members.pop(member, None)
            self._draining.pop(member, None)
            return False
        known = member in self._members
        self._members[member] = now
        self._draining[member] = set(data.get("draining") or ())
        return op == "join" or not known

    def beat(self, now: float, stale_before: float) -> None:
        """Note this member alive at ``now``; forget others not heard of since
        ``stale_before``."""
        for member, seen in list(self._members.items()):
            if member != self.member_id and seen < stale_before:
                del self._members[member]
                self._draining.pop(member, None)
        self._members[self.member_id] = now
