"""``RedisLimitBackend``: cluster limits in Redis (``Limit(..., scope="cluster",
backend="redis://host:6379/0")``), each change one Lua script, atomic on the server.

Per limit: ``<prefix>:<name>:slots`` a sorted set of held slots scored by their expiry (the
server's ``TIME``), ``<prefix>:<name>:tat`` the rate's next free moment, and
``<prefix>:<name>:breaker`` a hash of the breaker's record and its version. Expired slots
are dropped by the acquire that finds them, so a dead holder's slots are free ``ttl`` after
its last renewal without any sweeper.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlunsplit

import orjson

from ...errors import ConfigurationError, MissingDependencyError, StoreError
from ...limits.breaker import BreakerState
from ...limits.shared import Acquired
from ...limits.spec import Limit
from ...urls import redact_url, seconds_option, split_url, url_options

try:
    from redis import asyncio as aioredis
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("redis", "redis") from exc

__all__ = ["DEFAULT_PREFIX", "RedisLimitBackend"]

DEFAULT_PREFIX = "eventflow:limit"
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_TIMEOUT = 5.0
_OPTIONS = ("prefix", "connect_timeout", "timeout")

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1000000 "
_ACQUIRE = (
    _NOW
    + """
local conc = tonumber(ARGV[1]) local emission = tonumber(ARGV[2])
local tolerance = tonumber(ARGV[3]) local max_wait = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= conc then return {0, '0'} end
end
local wait = 0
if emission > 0 then
  local tat = tonumber(redis.call('GET', KEYS[2]) or '0')
  if tat < now then tat = now end
  wait = tat - now - tolerance
  if wait > max_wait then return {0, tostring(wait)} end
  redis.call('SET', KEYS[2], tostring(tat + emission), 'EX', math.ceil(tat - now + emission) + 60)
end
if conc > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[6])
  redis.call('EXPIRE', KEYS[1], math.ceil(ttl) + 60)
end
if wait < 0 then wait = 0 end
return {1, tostring(wait)}
"""
)
_RENEW = (
    _NOW
    + """
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(ttl) + 60)
return 0
"""
)
_STORE_BREAKER = """
local version = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if version ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'version', version + 1, 'state', ARGV[2])
return 1
"""


class RedisLimitBackend:
    """The ``LimitBackend`` of cluster limits with ``backend="redis://..."``."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self._client: Any = None
        self._scripts: dict[str, Any] = {}

    @classmethod
    def from_url(cls, url: str) -> RedisLimitBackend:
        """``redis://host:6379/0?prefix=NAME&connect_timeout=S&timeout=S``; an unknown
        option is refused."""
        parts = split_url(url, kind="Redis limit", form="redis://host:6379/0", port=6379)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigurationError(
                f"not a Redis URL: {redact_url(url)!r} (use redis://host:6379/0)"
            )
        options = url_options(url, _OPTIONS, kind="Redis limit")
        plain = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        return cls(
            plain,
            prefix=options.get("prefix", DEFAULT_PREFIX),
            connect_timeout=seconds_option(
                url, options, "connect_timeout", DEFAULT_CONNECT_TIMEOUT
            ),
            timeout=seconds_option(url, options, "timeout", DEFAULT_TIMEOUT),
        )

    async def open(self) -> None:
        """Connect, check that Redis answers and register the scripts. Idempotent."""
        if self._client is not None:
            return
        client = aioredis.from_url(
            self.url, socket_connect_timeout=self.connect_timeout, socket_timeout=self.timeout
        )
        try:
            async with asyncio.timeout(self.connect_timeout + self.timeout):
                await client.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            await client.aclose()
            raise StoreError(
                f"cannot reach the Redis limit backend at {redact_url(self.url)!r} within "
                f"{self.connect_timeout:g}s ({type(exc).__name__}: {exc}); check that "
                "redis-server runs there and the URL is right"
            ) from exc
        self._client = client
        for name, text in (
            ("acquire", _ACQUIRE),
            ("renew", _RENEW),
            ("store_breaker", _STORE_BREAKER),
        ):
            self._scripts[name] = client.register_script(text)

    async def close(self) -> None:
        """Close the connection pool. Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _key(self, limit: Limit, part: str) -> str:
        return f"{self.prefix}:{limit.name}:{part}"

    async def _call(self, what: str, limit: Limit, coro: Any) -> Any:
        if self._client is None:
            raise StoreError("the Redis limit backend is closed: open the app first")
        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreError(
                f"Redis limit {limit.name!r}: {what} failed on {redact_url(self.url)}: {exc}"
            ) from exc

    async def acquire(self, limit: Limit, slot: str, max_wait: float) -> Acquired:
        """One script: drop expired slots, check the count and the token, take both."""
        script = self._scripts.get("acquire")
        keys = [self._key(limit, "slots"), self._key(limit, "tat")]
        args = [
            limit.concurrency or 0,
            limit.emission,
            (limit.burst - 1) * limit.emission,
            max_wait,
            limit.ttl,
            slot,
        ]
        ok, wait = await self._call(
            "acquire", limit, script(keys=keys, args=args) if script else _closed()
        )
        return Acquired(bool(int(ok)), float(wait))

    async def release(self, limit: Limit, slot: str) -> None:
        """Remove the slot from the set."""
        client = self._client
        await self._call(
            "release", limit, client.zrem(self._key(limit, "slots"), slot) if client else _closed()
        )

    async def renew(self, limit: Limit, slots: Sequence[str]) -> None:
        """Move each held slot's expiry to ``ttl`` from now (``ZADD XX``: not one that
        expired and was dropped meanwhile)."""
        script = self._scripts.get("renew")
        keys = [self._key(limit, "slots")]
        await self._call(
            "renew", limit, script(keys=keys, args=[limit.ttl, *slots]) if script else _closed()
        )

    async def load_breaker(self, limit: Limit) -> tuple[BreakerState, int]:
        """The breaker's record and version."""
        client = self._client
        version, state = await self._call(
            "read breaker",
            limit,
            client.hmget(self._key(limit, "breaker"), "version", "state") if client else _closed(),
        )
        if not state:
            return BreakerState(), int(version or 0)
        return BreakerState.from_json(orjson.loads(state)), int(version or 0)

    async def store_breaker(self, limit: Limit, state: BreakerState, version: int) -> bool:
        """Compare-and-set the breaker's record."""
        script = self._scripts.get("store_breaker")
        keys = [self._key(limit, "breaker")]
        text = orjson.dumps(state.to_json()).decode()
        done = await self._call(
            "write breaker", limit, script(keys=keys, args=[version, text]) if script else _closed()
        )
        return bool(int(done))


async def _closed() -> Any:
    raise StoreError("the Redis limit backend is closed: open the app first")
