"""Attempt records of the memory store: kept in this process, bounded."""

from __future__ import annotations

from ...ports import AttemptRecord

__all__ = ["DEFAULT_ATTEMPTS_CAPACITY", "MemoryAttempts"]

DEFAULT_ATTEMPTS_CAPACITY = 100_000


class MemoryAttempts:
    """Records of messages not handled at their first delivery, per (group, message id).

    Not durable: a record dies with the process, so after a crash the consumer counts a
    message's unfinished deliveries from the broker's delivery count instead. At most
    ``capacity`` records are kept (the oldest is forgotten first); a record is dropped as
    soon as its message is handled or dead-lettered.
    """

    durable = False

    def __init__(self, capacity: int = DEFAULT_ATTEMPTS_CAPACITY) -> None:
        self.capacity = capacity
        self._records: dict[tuple[str, str], AttemptRecord] = {}

    async def get(self, group: str, message_id: str) -> AttemptRecord:
        """The message's record (an empty one when there is none)."""
        return self._records.get((group, message_id), AttemptRecord())

    async def started(self, group: str, message_id: str) -> AttemptRecord:
        """Count a redelivery whose handler starts now; return the record as it was."""
        key = (group, message_id)
        before = self._records.pop(key, AttemptRecord())
        self._put(key, AttemptRecord(before.failures, before.starts + 1))
        return before

    async def failed(self, group: str, message_id: str, error: str) -> None:
        """Count a failed handler attempt."""
        key = (group, message_id)
        before = self._records.pop(key, AttemptRecord())
        self._put(key, AttemptRecord(before.failures + 1, before.starts))

    async def clear(self, group: str, message_id: str) -> None:
        """Forget the message."""
        self._records.pop((group, message_id), None)

    def _put(self, key: tuple[str, str], record: AttemptRecord) -> None:
        records = self._records
        records[key] = record
        if len(records) > self.capacity:
            del records[next(iter(records))]

    def __len__(self) -> int:
        return len(self._records)
