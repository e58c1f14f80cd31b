"""``open_store(url)``: build a store adapter from a URL.

``memory://``, ``sqlite:///relative/path.db`` (``sqlite:////abs/path.db``),
``postgresql://user@host/db``. Adapters are imported only when their scheme is used.

Each adapter reads its URL's options through :mod:`eventflow.urls`: one it does not know is
refused, never ignored.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from .errors import ConfigurationError
from .ports import DedupStore, Store
from .urls import redact_url, url_scheme

__all__ = ["dedup_for", "open_store", "store_for"]


def _memory(url: str) -> Store:
    from .adapters.memory.store import MemoryStore

    return MemoryStore.from_url(url)


def _sqlite(url: str) -> Store:
    from .adapters.sqlite.store import SqliteStore

    return SqliteStore.from_url(url)


def _postgres(url: str) -> Store:
    from .adapters.postgres import PostgresStore

    return PostgresStore.from_url(url)


_SCHEMES = {
    "memory": _memory,
    "sqlite": _sqlite,
    "postgresql": _postgres,
    "postgres": _postgres,
}


def store_for(url: str | Store) -> Store:
    """Return an unopened store for ``url``; an adapter instance is returned as is."""
    if not isinstance(url, str):
        return url
    factory = _SCHEMES.get(url_scheme(url))
    if factory is None:
        raise ConfigurationError(
            f"unsupported store URL {redact_url(url)!r}: use memory://, sqlite:///path.db or "
            "postgresql://user@host/db"
        )
    return factory(url)


class _Opening:
    """Awaitable (``store = await open_store(url)``) and async context manager."""

    def __init__(self, url: str | Store) -> None:
        self._store = store_for(url)

    async def _open(self) -> Store:
        await self._store.open()
        return self._store

    def __await__(self) -> Generator[Any, None, Store]:
        return self._open().__await__()

    async def __aenter__(self) -> Store:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        await self._store.close()


def open_store(url: str | Store) -> _Opening:
    """Open a store: ``store = await open_store(url)`` or ``async with open_store(url) as s``."""
    return _Opening(url)


def dedup_for(url: str | DedupStore) -> DedupStore:
    """A dedup store for ``url`` (``redis://host:6379/0``); an instance is returned as is."""
    if not isinstance(url, str):
        return url
    scheme = url_scheme(url)
    if scheme in ("redis", "rediss"):
        from .adapters.redis import RedisDedupStore

        return RedisDedupStore.from_url(url)
    raise ConfigurationError(
        f"unsupported dedup URL {redact_url(url)!r}: use redis://host:6379/0, or leave dedup "
        "unset to use the store's own dedup table"
    )
