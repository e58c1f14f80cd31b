"""A Kafka group's lag (``KafkaBroker.lag``): over the partitions of the topics a pattern
matches, what the group has not committed, and the timestamp of the oldest such record.

The count of a partition is its end offset minus the group's committed offset (from the
partition's first offset where the group never committed, a topic created since it
exists): what Kafka's own tools call the lag. A group with no committed offset on any of
them does not exist yet and has ``Lag(0, None)``. The oldest record not handled on a
partition is the one at the committed offset (at the first offset still kept, where
retention deleted the records from there on), so its timestamp is the partition's oldest;
it is read with a fetch from a group-less client assigned to those partitions at those
offsets, and the partitions are paused again afterwards so the client fetches nothing in
between calls. ``KafkaBroker.lag`` bounds the whole call by ``LAG_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from ...ports import Lag, PartitionLag

__all__ = ["LAG_TIMEOUT", "PEEK_OPTIONS", "group_lag"]

LAG_TIMEOUT = 10.0
"""Seconds one ``lag`` call may take (its requests, the fetch of the oldest records)
before it raises ``BrokerError``: aiokafka's own request timeout is 40 s."""
_FETCH_WAIT_MS = 500

PEEK_OPTIONS: Mapping[str, Any] = {
    # A fetch returns a partition's first record batch whatever this limit (Kafka never
    # holds back the first batch), and nothing past it: the first record is all it needs.
    "max_partition_fetch_bytes": 1024,
    # Records deleted between the offset request and the fetch: read the first one kept.
    "auto_offset_reset": "earliest",
}
"""Options of the group-less client ``group_lag`` fetches with."""


async def group_lag(
    admin: AIOKafkaAdminClient,
    client: AIOKafkaConsumer,
    peeking: asyncio.Lock,
    group: str,
    ends: Mapping[Any, int],
) -> Lag:
    """The lag of ``group`` over the partitions ``ends`` gives the end offsets of, read
    with the group-less ``client`` (its assignment is this function's, under ``peeking``)."""
    if not ends:
        return Lag(0, None)
    tps = list(ends)
    committed = await admin.list_consumer_group_offsets(group, partitions=tps)
    done = {tp: int(committed[tp].offset) for tp in tps if tp in committed}
    done = {tp: offset for tp, offset in done.items() if offset >= 0}
    if not done:
        return Lag(0, None)  # no position anywhere: the group does not exist yet
    behind = [tp for tp, end in ends.items() if done.get(tp, -1) < end]
    if not behind:
        return Lag(0, None, tuple(PartitionLag(_name(tp), 0, None) for tp in tps))
    firsts = await client.beginning_offsets(behind)
    counts = dict.fromkeys(tps, 0)
    oldest_at: dict[Any, int] = {}  # partition -> offset of its oldest record not handled
    for tp in behind:
        end, first = ends[tp], int(firsts[tp])
        position = done.get(tp, first)
        counts[tp] = max(0, end - position)
        if max(position, first) < end:
            oldest_at[tp] = max(position, first)
    total = sum(counts.values())
    stamps = await _oldest(client, peeking, oldest_at) if oldest_at else {}
    parts = tuple(PartitionLag(_name(tp), counts[tp], stamps.get(tp)) for tp in tps)
    # None when what is left to handle was deleted by retention.
    return Lag(total, min(stamps.values()) if stamps else None, parts)


def _name(tp: Any) -> str:
    """A partition as ``PartitionLag`` names it: ``<kafka topic>/<partition>``."""
    return f"{tp.topic}/{tp.partition}"


async def _oldest(
    client: AIOKafkaConsumer, peeking: asyncio.Lock, offsets: Mapping[Any, int]
) -> dict[Any, datetime]:
    """The timestamp of the record at each of ``offsets`` (the first one at or after each
    offset; a partition whose record has none is left out); the caller bounds the wait."""
    tps = list(offsets)
    async with peeking:
        # No await between assign and seek: the client's fetcher starts at these offsets
        # rather than asking where to reset.
        client.assign(tps)
        for tp, offset in offsets.items():
            client.seek(tp, offset)
        stamps: dict[Any, int] = {}
        try:
            while len(stamps) < len(tps):
                missing = [tp for tp in tps if tp not in stamps]
                batch = await client.getmany(*missing, timeout_ms=_FETCH_WAIT_MS)
                for tp, records in batch.items():
                    if records and tp not in stamps:
                        stamps[tp] = records[0].timestamp
        finally:
            client.pause(*tps)
    # -1: a record of the old message format, without a timestamp.
    return {tp: datetime.fromtimestamp(ms / 1000, UTC) for tp, ms in stamps.items() if ms >= 0}
