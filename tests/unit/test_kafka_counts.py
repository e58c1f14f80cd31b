"""The Kafka adapter's delivery counts, carried between group members as a companion
group's committed offset: the encoding fits an int64 offset for every offset Kafka can have,
and reading it with the group's own committed offset gives what earlier members knew, also
when the companion's commit lagged behind (see ``eventflow/adapters/kafka/partition.py``)."""

from __future__ import annotations

import pytest

from eventflow.adapters.kafka.partition import (
    KafkaDelivery,
    MemberState,
    Partition,
    _pack,
    _unpack,
)

SPAN_MAX, COUNT_MAX = (1 << 16) - 1, (1 << 8) - 1
OFFSETS = [0, 1, 2**24, 2**39 - 1, 2**39, 2**40, 2**40 + 12345, 2**62, 2**63 - 1]


def _partition() -> Partition:
    return Partition(("topic", 0), MemberState())


@pytest.mark.parametrize("head", OFFSETS)
@pytest.mark.parametrize(
    ("span", "count"), [(0, 0), (1, 1), (SPAN_MAX, COUNT_MAX), (SPAN_MAX + 9, COUNT_MAX + 9)]
)
def test_round_trip_at_any_offset(head: int, span: int, count: int) -> None:
    """Any head below 2**63 packs into a valid offset (0 <= value < 2**63, so a commit
    cannot overflow) and comes back whole with the group's committed offset; span and
    count saturate at their limits."""
    value = _pack(head, span, count)
    assert 0 <= value < 2**63
    assert _unpack(value, head) == (head, min(span, SPAN_MAX), min(count, COUNT_MAX))


@pytest.mark.parametrize("head", [0, 7, 2**39 - 1, 2**40, 2**62])
def test_a_stale_companion_value_is_read_for_its_own_head(head: int) -> None:
    """The main commit succeeded, the companion's did not: the value still names its own
    (older) head, as long as the main offset moved less than 2**39 past it."""
    value = _pack(head, 3000, 4)
    for done in (head, head + 1, head + 2999, head + 3000, head + 2**39 - 1):
        assert _unpack(value, done) == (head, 3000, 4)


def test_prior_counts_with_a_main_commit_ahead_of_a_stale_companion() -> None:
    """Head P1 had 3000 offsets handed out and was delivered 4 times; then the main group
    committed P2 = P1 + 1000 without the companion. A new member resumes at P2: P2 up to
    P1 + 3000 were delivered once before, later ones never, and P1's count (a finished
    offset) is attributed to nothing it will deliver."""
    p1 = 2**40 + 5
    p2 = p1 + 1000
    part = _partition()
    part.set_prior(p2, _pack(p1, 3000, 4))
    assert part.prior(p2) == 1
    assert part.prior(p1 + 2999) == 1
    assert part.prior(p1 + 3000) == 0
    assert part.prior(p2 + 5000) == 0


def test_prior_counts_when_both_commits_succeeded() -> None:
    """The usual case: the head is the committed offset; it carries its count, the rest of
    the span one delivery each."""
    done = 2**39 + 77
    part = _partition()
    part.set_prior(done, _pack(done, 5, 3))
    assert [part.prior(done + i) for i in range(7)] == [3, 1, 1, 1, 1, 0, 0]


def test_a_stale_value_whose_span_ended_before_the_main_offset_claims_nothing() -> None:
    """Everything the old value covered is finished: nothing is counted."""
    part = _partition()
    part.set_prior(1000, _pack(10, 50, 9))
    assert all(part.prior(o) == 0 for o in (10, 59, 1000, 1001))


@pytest.mark.parametrize("head", [0, 12, 2**30, 2**39 - 1])
def test_values_of_the_old_encoding_are_read_as_meant(head: int) -> None:
    """The old encoding (``head << 24 | span << 8 | count``) could only be committed for
    heads below 2**39, where it is the same bits as the new one: read as it was written,
    fresh or stale."""
    old = head << 24 | 40 << 8 | 6
    assert old == _pack(head, 40, 6)
    assert _unpack(old, head) == (head, 40, 6)
    assert _unpack(old, head + 10) == (head, 40, 6)
    part = _partition()
    part.set_prior(head + 10, old)
    assert part.prior(head + 10) == 1 and part.prior(head + 40) == 0


def test_a_companion_value_ahead_of_the_main_offset_is_ignored_or_harmless() -> None:
    """Someone reset the group's offsets backwards: the companion value is ahead. With no
    matching head at or below the main offset it is ignored; with one, it claims deliveries
    only for offsets below the value's real head, which were indeed delivered before."""
    part = _partition()
    part.set_prior(10, _pack(1000, 5, 3))
    assert _unpack(_pack(1000, 5, 3), 10) is None
    assert all(part.prior(o) == 0 for o in range(0, 1100, 7))

    real_head = 2**41 + 100
    done = 2**41  # reset 100 offsets back: the value reads as a head 2**39 - 100 before
    part.set_prior(done, _pack(real_head, 200, 3))
    assert [o for o in range(done - 10, done + 400) if part.prior(o)] == []


class _Record:
    """What the partition reads of an aiokafka ``ConsumerRecord``."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.key = b"k"
        self.value = f"v{offset}".encode()
        self.headers = [("h", b"1")]


def _clock() -> float:
    return 0.0


async def test_a_partition_counts_its_own_deliveries_and_says_what_to_commit() -> None:
    """Without a subscription: filing fetched records (a refetch after a seek repeats
    some), handing them out, a nack and a release, and the commit they lead to. The shared
    member state follows every step."""
    member = MemberState()
    part = Partition(("topic", 0), member)
    part.start_from(10, _pack(10, 2, 3), refetch=True)  # offset 10 was delivered 3 times
    assert part.file([_Record(o) for o in (10, 11, 12)], "t") == 3
    assert part.file([_Record(o) for o in (11, 12, 13)], "t") == 1  # 11, 12 already queued
    assert member.buffered == 4 and part.next_offset == 14

    out: list[KafkaDelivery] = []
    part.take(out, 3, _clock)
    assert [(d.offset, d.delivery_count) for d in out] == [(10, 4), (11, 2), (12, 1)]
    assert out[0].payload == b"v10" and out[0].key == "k" and out[0].headers == {"h": "1"}
    assert member.buffered == 1 and member.dirty and part.handed_hi == 13
    assert part.to_commit() == (10, _pack(10, 3, 4))

    member.dirty = False
    await out[1].ack()
    await out[0].nack()
    await out[2].release()
    assert member.dirty and member.wakeup.is_set() and member.buffered == 3
    again: list[KafkaDelivery] = []
    part.take(again, 10, _clock)
    assert [(d.offset, d.delivery_count) for d in again] == [(10, 5), (12, 1), (13, 1)]
    for delivery in again:
        await delivery.ack()
    assert part.to_commit() == (14, _pack(14, 0, 0))
    part.committed = (14, _pack(14, 0, 0))
    assert part.to_commit() is None


def test_a_partition_resumed_from_a_commit_keeps_only_unfinished_records() -> None:
    """Assigned back with a committed offset ahead of some queued records: the finished
    ones go, the buffer count with them; fetching carries on after the last record."""
    member = MemberState()
    part = Partition(("topic", 0), member)
    part.start_from(0, None, refetch=True)
    part.file([_Record(o) for o in range(5)], "t")
    part.start_from(3, None, refetch=False)
    assert [d.offset for d in part.queue] == [3, 4] and member.buffered == 2
    assert part.resume_position() == 5 and part.position() == 3
    part.drop()
    assert member.buffered == 0 and not part.active


async def test_a_commit_keeps_what_earlier_members_delivered_until_it_is_finished() -> None:
    """A new owner learnt that offsets 10 to 19 were delivered before. It has handed out
    and finished only offset 10 when it commits: the value it commits must still say that
    11 to 19 were delivered before, or a third owner (after a crash of this one) would
    count their next deliveries as first ones."""
    member = MemberState()
    part = Partition(("topic", 0), member)
    part.start_from(10, _pack(10, 10, 2), refetch=True)
    part.file([_Record(o) for o in range(10, 25)], "t")
    out: list[KafkaDelivery] = []
    part.take(out, 1, _clock)
    assert [(d.offset, d.delivery_count) for d in out] == [(10, 3)]
    await out[0].ack()  # offset 10 finished
    assert part.to_commit() == (11, _pack(11, 9, 1))
    third = _partition()
    third.set_prior(11, _pack(11, 9, 1))
    assert [third.prior(o) for o in (11, 19, 20)] == [1, 1, 0]


def test_a_queued_head_keeps_its_count_from_earlier_members() -> None:
    """The head was delivered 3 times by earlier members; this member fetched it but has
    not handed it out yet when it commits: the count it commits is still 3, not 0."""
    member = MemberState()
    part = Partition(("topic", 0), member)
    part.start_from(10, _pack(10, 5, 3), refetch=True)
    part.file([_Record(o) for o in range(10, 13)], "t")
    assert part.to_commit() == (10, _pack(10, 5, 3))
