"""``RedisDedupStore``: handled (group, message id) pairs as Redis keys with a TTL.

Use it when consumers share no SQL store, or to keep dedup traffic off the database:
``App(..., dedup="redis://127.0.0.1:6379/0")``. Each pair is one key
``<prefix>:<group>:<id>`` set with ``SET ... NX EX retention``; ``seen`` is ``EXISTS``. A
Redis dedup entry cannot join a SQL transaction: with ``ctx.transaction()`` the app keeps
using its store's own dedup table for that handling.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ...errors import ConfigurationError, MissingDependencyError, StoreError

try:
    from redis import asyncio as aioredis
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("redis", "redis") from exc

__all__ = ["DEFAULT_PREFIX", "DEFAULT_RETENTION", "RedisDedupStore"]

DEFAULT_RETENTION = 7 * 24 * 3600
DEFAULT_PREFIX = "eventflow:dedup"


class RedisDedupStore:
    """Dedup entries in Redis, kept ``retention`` seconds."""

    def __init__(
        self, url: str, *, retention: int = DEFAULT_RETENTION, prefix: str = DEFAULT_PREFIX
    ) -> None:
        if retention < 1:
            raise ConfigurationError("the Redis dedup retention must be at least 1 second")
        self.url = url
        self.retention = retention
        self.prefix = prefix
        self._client: Any = None

    @classmethod
    def from_url(cls, url: str) -> RedisDedupStore:
        """``redis://host:6379/0?retention=SECONDS&prefix=NAME``."""
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigurationError(f"not a Redis URL: {url!r} (use redis://host:6379/0)")
        options = dict(parse_qsl(parts.query))
        retention = int(options.pop("retention", DEFAULT_RETENTION))
        prefix = options.pop("prefix", DEFAULT_PREFIX)
        if options:
            raise ConfigurationError(
                f"unknown Redis dedup option(s) {sorted(options)} in {url!r}; "
                "known: retention, prefix"
            )
        plain = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        return cls(plain, retention=retention, prefix=prefix)

    def _redis(self) -> Any:
        if self._client is None:
            self._client = aioredis.from_url(self.url)
        return self._client

    def _key(self, group: str, message_id: str) -> str:
        return f"{self.prefix}:{group}:{message_id}"

    async def seen(self, group: str, message_id: str) -> bool:
        """True if the pair was marked (by any process) within the retention."""
        try:
            return bool(await self._redis().exists(self._key(group, message_id)))
        except RedisError as exc:
            raise StoreError(f"Redis dedup check failed on {self.url}: {exc}") from exc

    async def mark(self, group: str, message_id: str) -> None:
        """Record the pair for ``retention`` seconds. Idempotent."""
        try:
            await self._redis().set(self._key(group, message_id), 1, ex=self.retention, nx=True)
        except RedisError as exc:
            raise StoreError(f"Redis dedup mark failed on {self.url}: {exc}") from exc

    async def close(self) -> None:
        """Close the connection pool. Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
