"""Redis adapters (redis-py's asyncio client): a dedup store shared by many processes."""

from .dedup import RedisDedupStore

__all__ = ("RedisDedupStore",)
