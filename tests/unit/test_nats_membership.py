"""The NATS adapter's group membership (``eventflow/adapters/nats/membership.py``): every
member computes the same assignment from the members it heard of, a newcomer is answered at
once, a member that stopped heartbeating is forgotten, and a partition another member is
still giving up counts as joined."""

from __future__ import annotations

import orjson

from eventflow.adapters.nats.membership import Membership


def _hb(member: str, op: str = "hb", draining: list[int] | None = None) -> bytes:
    return orjson.dumps({"id": member, "op": op, "draining": draining or []})


def test_members_split_the_partitions_the_same_way() -> None:
    a, b = Membership("a", 8, now=0.0), Membership("b", 8, now=0.0)
    assert a.desired() == set(range(8))
    a.heard(_hb("b", "join"), now=1.0)
    b.heard(_hb("a"), now=1.0)
    assert a.desired() == {0, 2, 4, 6}
    assert b.desired() == {1, 3, 5, 7}


def test_a_newcomer_is_answered_at_once_a_known_member_is_not() -> None:
    m = Membership("a", 4, now=0.0)
    assert m.heard(_hb("b"), now=1.0) is True  # first heard of: it must learn of us
    assert m.heard(_hb("b"), now=2.0) is False
    assert m.heard(_hb("b", "join"), now=3.0) is True  # joined again (restarted)
    assert m.heard(_hb("a"), now=4.0) is None  # our own heartbeat
    assert m.heard(b"not json", now=5.0) is None


def test_a_member_that_left_or_went_silent_is_forgotten() -> None:
    m = Membership("a", 4, now=0.0)
    m.heard(_hb("b"), now=0.0)
    m.heard(_hb("c"), now=0.0)
    assert m.desired() == {0, 3}
    assert m.heard(_hb("c", "leave"), now=1.0) is False
    assert m.desired() == {0, 2}
    m.beat(now=10.0, stale_before=5.0)  # b last heard of at 0
    assert m.desired() == {0, 1, 2, 3}
    m.heard(_hb("b"), now=11.0)
    m.beat(now=12.0, stale_before=7.0)  # b is fresh: kept
    assert m.desired() == {0, 2}


def test_joined_waits_for_partitions_not_held_unless_another_member_drains_them() -> None:
    m = Membership("a", 4, now=0.0)
    assert not m.joined([0, 1, 2])
    assert m.joined([0, 1, 2, 3])
    m.heard(_hb("z", draining=[3]), now=1.0)  # z gives partition 3 up; "a" gets 0 and 2
    assert m.desired() == {0, 2}
    assert not m.joined([0])
    assert m.joined([0, 2])
    m.heard(_hb("z", draining=[2]), now=2.0)
    assert m.joined([0])
