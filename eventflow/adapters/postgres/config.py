"""The PostgreSQL store's settings, read from its URL."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlencode, urlunsplit

from ...errors import ConfigurationError
from ...leases import DEFAULT_LEASE_TTL
from ...urls import count_option, redact_url, seconds_option, split_url, url_options

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_MAX_POOL",
    "DEFAULT_MIN_POOL",
    "DRIVER_OPTIONS",
    "OWN_OPTIONS",
    "PostgresConfig",
]

DEFAULT_MIN_POOL = 2
DEFAULT_MAX_POOL = 10
MAX_POOL = 1000
"""The largest ``pool=``: asyncpg sets up every slot of a pool when it opens it, so a
mistyped huge number would hang the process (and no server takes that many clients)."""
DEFAULT_CONNECT_TIMEOUT = 10.0

OWN_OPTIONS = ("schema", "pool", "connect_timeout", "lease_ttl")
"""Query options eventflow reads itself (and removes from the driver's DSN)."""
DRIVER_OPTIONS = (
    "application_name",
    "dbname",
    "database",
    "gsslib",
    "host",
    "krbsrvname",
    "passfile",
    "password",
    "port",
    "service",
    "ssl_max_protocol_version",
    "ssl_min_protocol_version",
    "sslcert",
    "sslcrl",
    "sslkey",
    "sslmode",
    "sslnegotiation",
    "sslpassword",
    "sslrootcert",
    "target_session_attrs",
    "user",
)
"""libpq connection options asyncpg reads from a DSN's query, passed through unchanged.
(asyncpg would send any other name to the server as a setting, so a typo such as
``?sslmod=`` would surface only as a server error at connect time: it is refused here.)"""
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "target_session_attrs": (
        "any",
        "primary",
        "standby",
        "prefer-standby",
        "read-write",
        "read-only",
    ),
}


@dataclass(frozen=True, slots=True)
class PostgresConfig:
    """Where and how to connect. ``schema`` puts eventflow's tables in that schema.

    ``connect_timeout``: seconds a new connection may take (the first one at ``open()``
    included) before it fails with a ``StoreError``; ``lease_ttl``: seconds a dead holder
    keeps a lease before another process takes it.
    """

    dsn: str
    schema: str = "public"
    min_pool: int = DEFAULT_MIN_POOL
    max_pool: int = DEFAULT_MAX_POOL
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    lease_ttl: float = DEFAULT_LEASE_TTL

    @classmethod
    def from_url(cls, url: str) -> PostgresConfig:
        """``postgresql://user@host:5432/db?schema=NAME&pool=10&connect_timeout=10&lease_ttl=10``.

        The libpq options asyncpg understands (``sslmode``, ``sslrootcert``,
        ``application_name``, ... see ``DRIVER_OPTIONS``) go to the driver unchanged; any
        other option is refused with a ``ConfigurationError`` listing the known ones.
        """
        parts = split_url(
            url, kind="PostgreSQL store", form="postgresql://user@host:5432/db", port=5432
        )
        if parts.scheme not in ("postgresql", "postgres"):
            raise ConfigurationError(
                f"not a PostgreSQL URL: {redact_url(url)!r} (use postgresql://user@host/db)"
            )
        options = url_options(url, OWN_OPTIONS + DRIVER_OPTIONS, kind="PostgreSQL store")
        schema = options.get("schema", "public")
        if not schema.replace("_", "").isalnum():
            raise ConfigurationError(
                f"store URL option schema={schema!r} in {redact_url(url)!r} must be a schema "
                "name of letters, digits and _"
            )
        for name, allowed in _CHOICES.items():
            if name in options and options[name] not in allowed:
                raise ConfigurationError(
                    f"store URL option {name}={options[name]!r} in {redact_url(url)!r} must be "
                    f"one of {', '.join(allowed)}"
                )
        pool = count_option(url, options, "pool", DEFAULT_MAX_POOL, maximum=MAX_POOL)
        driver = [(k, v) for k, v in options.items() if k not in OWN_OPTIONS]
        dsn = urlunsplit(("postgresql", parts.netloc, parts.path, urlencode(driver), ""))
        return cls(
            dsn=dsn,
            schema=schema,
            min_pool=min(DEFAULT_MIN_POOL, pool),
            max_pool=pool,
            connect_timeout=seconds_option(
                url, options, "connect_timeout", DEFAULT_CONNECT_TIMEOUT
            ),
            lease_ttl=seconds_option(url, options, "lease_ttl", DEFAULT_LEASE_TTL),
        )
