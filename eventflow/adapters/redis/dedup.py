"""``RedisDedupStore``: handled (group, message id) pairs as Redis keys with a TTL.

Use it when consumers share no SQL store, or to keep dedup traffic off the database:
``App(..., dedup="redis://127.0.0.1:6379/0")``. Each pair is one key
``<prefix>:<group>:<id>`` set with ``SET ... NX EX retention``; ``seen`` is ``EXISTS``. Its
value is ``1`` for a handled message, or a JSON object ``{"cancelled_by": "<id>"}`` for one
a compensation cancelled before it was handled (one ``SET NX``: the first record wins). A
Redis dedup entry cannot join a SQL transaction: with ``ctx.transaction()`` the app keeps
using its store's own dedup table for that handling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlunsplit

import orjson

from ...errors import ConfigurationError, MissingDependencyError, StoreError
from ...urls import count_option, redact_url, seconds_option, split_url, url_options

try:
    from redis import asyncio as aioredis
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("redis", "redis") from exc

__all__ = ["DEFAULT_PREFIX", "DEFAULT_RETENTION", "RedisDedupStore"]

DEFAULT_RETENTION = 7 * 24 * 3600
DEFAULT_PREFIX = "eventflow:dedup"
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_TIMEOUT = 5.0
_OPTIONS = ("retention", "prefix", "connect_timeout", "timeout")


class RedisDedupStore:
    """Dedup entries in Redis, kept ``retention`` seconds.

    ``connect_timeout`` bounds the first connection (``open`` fails with a ``StoreError``
    naming the URL past it) and ``timeout`` every command, so a Redis that stops answering
    fails a lookup (the consumer gives the message back) instead of hanging it.
    """

    def __init__(
        self,
        url: str,
        *,
        retention: int = DEFAULT_RETENTION,
        prefix: str = DEFAULT_PREFIX,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if retention < 1:
            raise ConfigurationError("the Redis dedup retention must be at least 1 second")
        self.url = url
        self.retention = retention
        self.prefix = prefix
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self._client: Any = None

    @classmethod
    def from_url(cls, url: str) -> RedisDedupStore:
        """``redis://host:6379/0?retention=SECONDS&prefix=NAME&connect_timeout=S&timeout=S``;
        an unknown option is refused."""
        parts = split_url(url, kind="Redis dedup", form="redis://host:6379/0", port=6379)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigurationError(
                f"not a Redis URL: {redact_url(url)!r} (use redis://host:6379/0)"
            )
        options = url_options(url, _OPTIONS, kind="Redis dedup")
        plain = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        return cls(
            plain,
            retention=count_option(url, options, "retention", DEFAULT_RETENTION),
            prefix=options.get("prefix", DEFAULT_PREFIX),
            connect_timeout=seconds_option(
                url, options, "connect_timeout", DEFAULT_CONNECT_TIMEOUT
            ),
            timeout=seconds_option(url, options, "timeout", DEFAULT_TIMEOUT),
        )

    def _redis(self) -> Any:
        if self._client is None:
            self._client = aioredis.from_url(
                self.url,
                socket_connect_timeout=self.connect_timeout,
                socket_timeout=self.timeout,
            )
        return self._client

    async def open(self) -> None:
        """Connect and check that Redis answers, within ``connect_timeout``; else raise a
        ``StoreError`` naming the URL. Idempotent."""
        try:
            async with asyncio.timeout(self.connect_timeout + self.timeout):
                await self._redis().ping()
        except (RedisError, OSError, TimeoutError) as exc:
            await self.close()
            raise StoreError(
                f"cannot reach the Redis dedup store at {redact_url(self.url)!r} within "
                f"{self.connect_timeout:g}s ({type(exc).__name__}: {exc}); check that "
                "redis-server runs there and the URL (host, port, database) is right"
            ) from exc

    def _key(self, group: str, message_id: str) -> str:
        return f"{self.prefix}:{group}:{message_id}"

    async def seen(self, group: str, message_id: str) -> bool:
        """True if the pair was marked (by any process) within the retention."""
        try:
            return bool(await self._redis().exists(self._key(group, message_id)))
        except (RedisError, OSError) as exc:
            raise StoreError(f"Redis dedup check failed on {redact_url(self.url)}: {exc}") from exc

    async def seen_many(self, group: str, message_ids: Sequence[str]) -> set[str]:
        """The ids of ``message_ids`` marked (by any process) within the retention, in one
        ``MGET``."""
        ids = list(message_ids)
        if not ids:
            return set()
        try:
            values = await self._redis().mget([self._key(group, m) for m in ids])
        except (RedisError, OSError) as exc:
            raise StoreError(f"Redis dedup check failed on {redact_url(self.url)}: {exc}") from exc
        return {m for m, value in zip(ids, values, strict=True) if value is not None}

    async def mark(self, group: str, message_id: str) -> None:
        """Record the pair for ``retention`` seconds. Idempotent."""
        await self.mark_new(group, message_id)

    async def mark_new(
        self, group: str, message_id: str, *, cancelled_by: str | None = None
    ) -> bool:
        """Record the pair for ``retention`` seconds unless it is there (``SET NX``); True if
        this call recorded it."""
        value: bytes | int = 1
        if cancelled_by is not None:
            value = orjson.dumps({"cancelled_by": cancelled_by})
        try:
            added = await self._redis().set(
                self._key(group, message_id), value, ex=self.retention, nx=True
            )
        except (RedisError, OSError) as exc:
            raise StoreError(f"Redis dedup mark failed on {redact_url(self.url)}: {exc}") from exc
        return bool(added)

    async def cancelled_by(self, group: str, message_id: str) -> str | None:
        """The compensation that cancelled the pair, if one did (within the retention)."""
        try:
            raw = await self._redis().get(self._key(group, message_id))
        except (RedisError, OSError) as exc:
            raise StoreError(f"Redis dedup check failed on {redact_url(self.url)}: {exc}") from exc
        if raw is None:
            return None
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None  # not written by eventflow: a plain record
        by = value.get("cancelled_by") if isinstance(value, dict) else None
        return by if isinstance(by, str) else None

    async def close(self) -> None:
        """Close the connection pool. Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
