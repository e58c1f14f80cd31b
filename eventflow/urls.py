"""Reading adapter URLs: query options the same way for every store and broker (an option
the adapter does not know, a repeated one or a value of the wrong kind is a
``ConfigurationError`` naming it, never silently ignored), and ``redact_url`` to show a URL in
a message or a log without its password."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .errors import ConfigurationError

__all__ = ["count_option", "redact_url", "seconds_option", "url_options"]

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
    """The query options of adapter URL ``url``; refuse any not in ``known`` or repeated.

    ``kind`` names the adapter in messages (``"SQLite store"``, ``"memory broker"``)."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if name not in known:
            listing = ", ".join(sorted(known)) if known else "none (remove the query)"
            raise ConfigurationError(
                f"{kind} URL {redact_url(url)!r} has an unknown option {name!r}; "
                f"the options it knows: {listing}"
            )
        if name in options:
            raise ConfigurationError(
                f"{kind} URL {redact_url(url)!r} gives option {name!r} twice; keep one"
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
            f"URL option {name}={raw!r} in {redact_url(url)!r} must be a number of "
            f"seconds > 0, e.g. {name}={default:g}"
        )
    return value


def count_option(
    url: str,
    options: Mapping[str, str],
    name: str,
    default: int,
    *,
    minimum: int = 1,
    maximum: int | None = None,
) -> int:
    """Option ``name`` as a whole number >= ``minimum`` (and <= ``maximum``), else
    ``default``."""
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigurationError(
            f"URL option {name}={raw!r} in {redact_url(url)!r} must be a whole number "
            f"{bounds}, e.g. {name}={default}"
        )
    return value
