"""In-process adapters: a real broker and a real store, for the embedded default and tests."""

from .broker import MemoryBroker
from .store import MemoryDeadLetterStore, MemoryDedupStore, MemoryHeartbeats, MemoryStore

__all__ = (
    "MemoryBroker",
    "MemoryDeadLetterStore",
    "MemoryDedupStore",
    "MemoryHeartbeats",
    "MemoryStore",
)
