"""A NATS partition (``eventflow/adapters/nats/partition.py``) and its lease: it pulls and
extends ack timers only while its lease outlives what they start, hands out nothing once
the lease may have lapsed, and drops the redelivery of a message it still holds (its ack
timer ran out while the process stalled)."""

from __future__ import annotations

from typing import Any

from eventflow.adapters.nats.delivery import NatsDelivery
from eventflow.adapters.nats.partition import IN_PROGRESS, Partition

ACK_WAIT, MARGIN, TTL = 4.0, 0.5, 6.8


class FakeNats:
    """Records what the partition publishes."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "") -> None:
        self.sent.append((subject, payload))


class FakeMember:
    """The member holding the partition, with a clock the test moves."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.closed = False
        self.woken = 0

    def now(self) -> float:
        return self.clock

    def kick(self) -> None:
        pass

    def wake(self) -> None:
        self.woken += 1


def _partition(nc: FakeNats, member: FakeMember) -> Partition:
    nc_any: Any = nc
    return Partition(
        0,
        "c_0",
        "S",
        "_INBOX.x",
        "g.0",
        1,
        member.clock + TTL,
        member=member,
        nc=nc_any,
        releases=None,  # type: ignore[arg-type]  # no release is recorded here
        await_guard=2 * ACK_WAIT,
        pull_guard=ACK_WAIT + MARGIN,
    )


def _delivery(part: Partition, seq: int, count: int = 1) -> NatsDelivery:
    reply = f"$JS.ACK.S.c_0.{count}.{seq}.{seq}.0.0"
    return NatsDelivery(part, reply, "t", b"m%d" % seq, "k", {}, seq, seq, count, 0)


def _take(part: Partition, now: float) -> list[int]:
    out: list[NatsDelivery] = []
    part.take(out, 10, now)
    return [d.seq for d in out]


async def test_pulls_and_heartbeats_only_while_the_lease_outlives_their_ack_timers() -> None:
    nc, member = FakeNats(), FakeMember()
    part = _partition(nc, member)
    await part.pull(10, 1.0, now=0.0)
    assert len(nc.sent) == 1, "a fresh lease: pull"
    part.pull_ended(part.pull_id, expired=True)
    # 1.0 s of pull + 4 s of ack timer + 0.5 s margin no longer fit before 6.8 s.
    await part.pull(10, 1.0, now=1.5)
    assert len(nc.sent) == 1, "what the pull could bring would outlive the lease"
    await part.pull(10, 0.2, now=1.5)
    assert len(nc.sent) == 2, "a shorter pull still fits"
    part.pull_ended(part.pull_id, expired=True)
    part.received(_delivery(part, 1), 1)
    out: list[NatsDelivery] = []
    part.take(out, 10, 1.5)
    [d] = out
    member.clock = 2.0
    await d.in_progress()
    assert nc.sent[-1] == (d.reply, IN_PROGRESS)
    member.clock = 2.5  # 2.5 + 4.5 > 6.8: the timer would end after the lease
    sent = len(nc.sent)
    await d.in_progress()
    await part.keep_alive()
    assert len(nc.sent) == sent
    part.lease_until = member.clock + TTL  # refreshed
    await part.keep_alive()
    assert nc.sent[-1] == (d.reply, IN_PROGRESS)


async def test_hands_out_nothing_once_the_lease_may_have_lapsed() -> None:
    nc, member = FakeNats(), FakeMember()
    part = _partition(nc, member)
    part.received(_delivery(part, 1), 1)
    part.received(_delivery(part, 2), 1)
    assert _take(part, now=TTL) == [], "at lease_until another member may hold it"
    part.lease_until = 2 * TTL  # the refresh went through
    assert _take(part, now=TTL) == [1, 2]


async def test_a_redelivery_of_a_message_still_held_is_dropped() -> None:
    nc, member = FakeNats(), FakeMember()
    part = _partition(nc, member)
    for seq in (1, 2, 3):
        part.received(_delivery(part, seq), 1)
    out: list[NatsDelivery] = []
    part.take(out, 1, 0.0)  # 1 handed out, 2 and 3 buffered
    # The process stalled past ack_wait: the server redelivers what it holds, to it.
    part.received(_delivery(part, 1, count=2), 2)
    part.received(_delivery(part, 3, count=2), 2)
    assert [d.seq for d in part.buffer] == [2, 3]
    assert list(part.out) == [1]
    # A message it gave back (nack) is awaited: its redelivery is taken.
    [first] = out
    await first.nack()
    part.received(_delivery(part, 1, count=2), 2)
    assert _take(part, now=0.0) == [1, 2, 3]
