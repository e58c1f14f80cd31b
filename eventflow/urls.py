"""Reading adapter URLs the same way for every store and broker: ``split_url`` (a URL that
cannot be read, such as an unclosed ``[``, or a host's port that is not a number from 0 to
65535, is a ``ConfigurationError`` showing the right form, never a ``ValueError`` from
urllib), query options (an option the adapter does not know, a repeated one or a value of
the wrong kind is a ``ConfigurationError`` naming it, never silently ignored), and
``redact_url`` to show a URL in a message or a log without its password."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

from .errors import ConfigurationError

__all__ = [
    "count_option",
    "redact_url",
    "seconds_option",
    "split_url",
    "url_options",
    "url_scheme",
]

_SECRET_OPTIONS = frozenset({"password", "sslpassword"})
# The password of a URL urllib cannot split: scheme://user:PASSWORD@...
_USER_PASSWORD = re.compile(r"(//[^/@:]*:)[^/@]*@")
_MAX_PORT = 65535


def url_scheme(url: str) -> str:
    """The scheme of ``url`` (``postgresql``), also of one whose host part cannot be read,
    so that the adapter it names reports what is wrong with it."""
    try:
        return urlsplit(url).scheme
    except ValueError:
        return urlsplit(url.partition("//")[0]).scheme


def split_url(url: str, *, kind: str, form: str = "", port: int | None = None) -> SplitResult:
    """``urlsplit(url)``, with every host's port checked (``h1:4222,h2:4222`` too).

    A URL urllib cannot read, or a port that is not a number from 0 to 65535, is a
    ``ConfigurationError`` naming ``kind`` (``"PostgreSQL store"``) and showing ``form``,
    the right form (``"postgresql://user@host:5432/db"``), and how to write an IPv6 host
    with the default ``port``."""
    right = f"; write it as {form}" if form else ""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        ipv6 = f" (an IPv6 host goes in brackets: [::1]:{port})" if port is not None else ""
        raise ConfigurationError(
            f"{kind} URL {redact_url(url)!r} cannot be read ({exc}){right}{ipv6}"
        ) from None
    hosts = parts.netloc.rpartition("@")[2]
    for host in hosts.split(","):
        given = _port_of(host)
        if given and not (given.isdigit() and int(given) <= _MAX_PORT):
            raise ConfigurationError(
                f"{kind} URL {redact_url(url)!r} has port {given!r} for host "
                f"{host.rpartition(':')[0]!r}: a port is a number from 0 to {_MAX_PORT}{right}"
            )
    return parts


def _port_of(host: str) -> str:
    """The port written after ``host`` (``""``: none): after the ``]`` of an IPv6 address."""
    if host.startswith("["):
        return host.partition("]")[2].removeprefix(":")
    return host.rpartition(":")[2] if ":" in host else ""


def redact_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` option) shown as
    ``***``: the form to put in messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:  # a URL urllib cannot split: hide what stands where a password would
        return _USER_PASSWORD.sub(r"\1***@", url)
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
    for name, value in parse_qsl(split_url(url, kind=kind).query, keep_blank_values=True):
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
