"""``open_store(url)``: build a store adapter from a URL.

``memory://``, ``sqlite:///relative/path.db`` (``sqlite:////abs/path.db``),
``postgresql://user@host/db``. Adapters are imported only when their scheme is used.

The helpers below read a store URL's query options the same way for every adapter: an
option the adapter does not know, a repeated one or a value of the wrong kind is a
``ConfigurationError`` naming the option, never silently ignored. Messages show URLs
through ``redact_url``, without their password.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Generator, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .errors import ConfigurationError
from .ports import DedupStore, Store

__all__ = [
    "count_option",
    "dedup_for",
    "open_store",
    "redact_url",
    "seconds_option",
    "store_for",
    "url_options",
]

_SECRET_OPTIONS = frozenset({"password", "sslpassword"})


def redact_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` option) shown as
    ``***``: the form to put in messages and logs."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    userinfo, at, hosts = netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if at and colon:
        netloc = f"{user}:***@{hosts}"
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(name in _SECRET_OPTIONS for name, _ in pairs):
        hidden = [(n, "***" if n in _SECRET_OPTIONS else v) for n, v in pairs]
        query = urlencode(hidden, safe="*/:")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # untouched (urlunsplit would rewrite sqlite:////abs.db)
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def url_options(url: str, known: Collection[str], *, kind: str) -> dict[str, str]:
    """The query options of store URL ``url``; refuse any not in ``known`` or repeated.

    ``kind`` names the adapter in messages (``"SQLite"``)."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if name not in known:
            listing = ", ".join(sorted(known)) if known else "none (remove the query)"
            raise ConfigurationError(
                f"{kind} store URL {redact_url(url)!r} has an unknown option {name!r}; "
                f"the options it knows: {listing}"
            )
        if name in options:
            raise ConfigurationError(
                f"{kind} store URL {redact_url(url)!r} gives option {name!r} twice; keep one"
            )
        options[name] = value
    return options


def seconds_option(url: str, options: Mapping[str, str], name: str, default: float) -> float:
    """Option ``name`` as a duration in seconds (a finite number > 0), else ``default``."""
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigurationError(
            f"store URL option {name}={raw!r} in {redact_url(url)!r} must be a number of "
            f"seconds > 0, e.g. {name}={default:g}"
        )
    return value


def count_option(
    url: str, options: Mapping[str, str], name: str, default: int, *, minimum: int = 1
) -> int:
    """Option ``name`` as a whole number >= ``minimum``, else ``default``."""
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigurationError(
            f"store URL option {name}={raw!r} in {redact_url(url)!r} must be a whole number "
            f">= {minimum}, e.g. {name}={default}"
        )
    return value


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
    factory = _SCHEMES.get(urlsplit(url).scheme)
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
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss"):
        from .adapters.redis import RedisDedupStore

        return RedisDedupStore.from_url(url)
    raise ConfigurationError(
        f"unsupported dedup URL {url!r}: use redis://host:6379/0, or leave dedup unset to use "
        "the store's own dedup table"
    )
