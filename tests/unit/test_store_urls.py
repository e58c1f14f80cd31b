"""Store URLs: the accepted forms, their options, and mistakes refused with a clear message."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from eventflow import ConfigurationError
from eventflow.adapters.memory.store import MemoryStore
from eventflow.adapters.postgres import PostgresConfig, PostgresStore
from eventflow.adapters.postgres.db import DEFAULT_CONNECT_TIMEOUT
from eventflow.adapters.sqlite import SqliteStore
from eventflow.adapters.sqlite.db import DEFAULT_BUSY_TIMEOUT
from eventflow.leases import DEFAULT_LEASE_TTL
from eventflow.stores import store_for
from eventflow.urls import redact_url

# -- memory:// ---------------------------------------------------------------------------------


def test_memory_url_takes_no_options() -> None:
    assert isinstance(store_for("memory://"), MemoryStore)
    with pytest.raises(ConfigurationError) as info:
        store_for("memory://?capacity=10")
    text = str(info.value)
    assert "'capacity'" in text
    assert "none" in text  # the known options: none


# -- sqlite: the path ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///relative.db", "relative.db"),
        ("sqlite:///dir/relative.db", "dir/relative.db"),
        ("sqlite:////absolute/path.db", "/absolute/path.db"),
        ("sqlite:///:memory:", ":memory:"),
        ("sqlite:///a%20b.db", "a b.db"),
        ("sqlite:///a%23b.db", "a#b.db"),
    ],
)
def test_sqlite_url_forms(url: str, path: str) -> None:
    store = store_for(url)
    assert isinstance(store, SqliteStore)
    assert store.path == path
    assert store.url == url


@pytest.mark.parametrize(
    ("url", "right"),
    [
        # One slash: urlsplit reads it like sqlite:///x.db, which opened ./x.db.
        ("sqlite:/x.db", "sqlite:////x.db"),
        ("sqlite:/var/data/x.db", "sqlite:////var/data/x.db"),
        ("sqlite:x.db", "sqlite:///x.db"),
        ("sqlite:data/x.db?busy_timeout=2", "sqlite:///data/x.db?busy_timeout=2"),
        ("sqlite::memory:", "sqlite:///:memory:"),
        ("sqlite://x.db", "sqlite:///x.db"),
    ],
)
def test_sqlite_urls_without_the_three_slashes_are_refused_with_the_right_form(
    url: str, right: str
) -> None:
    with pytest.raises(ConfigurationError, match="SQLite URL") as info:
        SqliteStore.from_url(url)
    assert right in str(info.value)


def test_one_slash_sqlite_url_creates_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError):
        store_for("sqlite:/x.db")
    assert not (tmp_path / "x.db").exists()


@pytest.mark.parametrize("url", ["sqlite:", "sqlite:/", "sqlite://", "sqlite:///"])
def test_sqlite_url_without_a_file_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="names no file"):
        SqliteStore.from_url(url)


def test_sqlite_url_fragment_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="%23"):
        SqliteStore.from_url("sqlite:///a#b.db")


# -- sqlite: options ----------------------------------------------------------------------------


def test_sqlite_defaults() -> None:
    store = SqliteStore.from_url("sqlite:///x.db")
    assert store.busy_timeout == DEFAULT_BUSY_TIMEOUT
    assert store.db.busy_timeout == DEFAULT_BUSY_TIMEOUT
    assert store.lease_ttl == DEFAULT_LEASE_TTL


def test_sqlite_options_reach_the_store() -> None:
    store = SqliteStore.from_url("sqlite:///x.db?busy_timeout=0.5&lease_ttl=3")
    assert store.busy_timeout == 0.5
    assert store.db.busy_timeout == 0.5
    assert store.lease_ttl == 3.0
    assert store.leases.ttl == 3.0


def test_sqlite_constructor_takes_the_settings() -> None:
    store = SqliteStore("x.db", busy_timeout=1.5, lease_ttl=4.0)
    assert (store.busy_timeout, store.db.busy_timeout, store.lease_ttl) == (1.5, 1.5, 4.0)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///x.db?timeout=5",
        "sqlite:///x.db?busy_timout=5",  # a typo
        "sqlite:///x.db?busy_timeout=5&journal=wal",
    ],
)
def test_sqlite_unknown_options_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="unknown option") as info:
        store_for(url)
    assert "busy_timeout, lease_ttl" in str(info.value)


@pytest.mark.parametrize(
    ("query", "option"),
    [
        ("busy_timeout=abc", "busy_timeout"),
        ("busy_timeout=0", "busy_timeout"),
        ("busy_timeout=-1", "busy_timeout"),
        ("busy_timeout=", "busy_timeout"),
        ("busy_timeout=inf", "busy_timeout"),
        ("lease_ttl=10s", "lease_ttl"),
        ("lease_ttl=nan", "lease_ttl"),
    ],
)
def test_sqlite_bad_durations_name_the_option(query: str, option: str) -> None:
    with pytest.raises(ConfigurationError, match=f"{option}=.*seconds > 0"):
        store_for(f"sqlite:///x.db?{query}")


def test_repeated_option_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="twice"):
        store_for("sqlite:///x.db?busy_timeout=1&busy_timeout=2")


# -- postgresql ---------------------------------------------------------------------------------


def _query(dsn: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(dsn).query))


def test_postgres_defaults() -> None:
    cfg = PostgresConfig.from_url("postgresql://u@db.example:5432/app")
    assert cfg.dsn == "postgresql://u@db.example:5432/app"
    assert cfg.schema == "public"
    assert cfg.max_pool == 10
    assert cfg.connect_timeout == DEFAULT_CONNECT_TIMEOUT == 10.0
    assert cfg.lease_ttl == DEFAULT_LEASE_TTL


def test_postgres_own_options_are_read_and_kept_from_the_driver() -> None:
    cfg = PostgresConfig.from_url(
        "postgres://u@h/app?schema=shop&pool=4&connect_timeout=2.5&lease_ttl=7"
    )
    assert (cfg.schema, cfg.max_pool, cfg.min_pool) == ("shop", 4, 2)
    assert (cfg.connect_timeout, cfg.lease_ttl) == (2.5, 7.0)
    assert cfg.dsn == "postgresql://u@h/app"
    assert PostgresConfig.from_url("postgresql://h/app?pool=1").min_pool == 1


def test_postgres_driver_options_pass_through_unchanged() -> None:
    url = (
        "postgresql://u@h/app?schema=s&sslmode=verify-full&sslrootcert=/etc/ssl/a%20b.pem"
        "&application_name=billing&target_session_attrs=read-write&passfile=/run/pgpass"
    )
    assert _query(PostgresConfig.from_url(url).dsn) == {
        "sslmode": "verify-full",
        "sslrootcert": "/etc/ssl/a b.pem",
        "application_name": "billing",
        "target_session_attrs": "read-write",
        "passfile": "/run/pgpass",
    }


@pytest.mark.parametrize(
    "option", ["sslmod=require", "search_path=x", "poolsize=3", "timeout=3", "connect_timout=1"]
)
def test_postgres_unknown_options_are_refused(option: str) -> None:
    with pytest.raises(ConfigurationError, match="unknown option") as info:
        PostgresConfig.from_url(f"postgresql://u@h/app?{option}")
    text = str(info.value)
    for known in ("schema", "pool", "connect_timeout", "lease_ttl", "sslmode", "sslrootcert"):
        assert known in text


@pytest.mark.parametrize("pool", ["abc", "0", "-2", "2.5", ""])
def test_postgres_bad_pool_is_a_configuration_error_naming_the_option(pool: str) -> None:
    with pytest.raises(ConfigurationError, match=r"pool=.*whole number from 1 to 1000"):
        store_for(f"postgresql://u@h/app?pool={pool}")


@pytest.mark.parametrize("query", ["connect_timeout=soon", "connect_timeout=0", "lease_ttl=-3"])
def test_postgres_bad_durations_name_the_option(query: str) -> None:
    option = query.partition("=")[0]
    with pytest.raises(ConfigurationError, match=f"{option}=.*seconds > 0"):
        PostgresStore.from_url(f"postgresql://u@h/app?{query}")


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("sslmode=maybe", "verify-full"),
        ("target_session_attrs=primry", "read-write"),
        ("schema=bad-name", "letters, digits and _"),
    ],
)
def test_postgres_bad_option_values_are_refused(query: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        PostgresConfig.from_url(f"postgresql://u@h/app?{query}")


def test_postgres_messages_never_show_the_password() -> None:
    for url in (
        "postgresql://u:s3cret@h/app?pool=x",
        "postgresql://u:s3cret@h/app?bogus=1",
        "postgresql://u@h/app?password=s3cret&bogus=1",
    ):
        with pytest.raises(ConfigurationError) as info:
            PostgresConfig.from_url(url)
        assert "s3cret" not in str(info.value)
        assert "***" in str(info.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:pw@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql://u:p%40w@h/db?sslmode=require", "postgresql://u:***@h/db?sslmode=require"),
        ("postgresql://u@h/db?password=pw&x=1", "postgresql://u@h/db?password=***&x=1"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# -- host and port: a URL that cannot be read is a ConfigurationError with the right form ------


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("postgresql://h:abc/db", ["port 'abc'", "postgresql://user@host:5432/db"]),
        ("postgresql://u:secret@h:99999/db", ["port '99999'", "0 to 65535"]),
        ("postgresql://h1:5432,h2:x/db", ["port 'x'"]),
        ("postgresql://[::1/db", ["cannot be read", "[::1]:5432"]),
        ("sqlite://[x/a.db", ["cannot be read"]),
        ("memory://[x", ["cannot be read"]),
    ],
)
def test_a_bad_port_or_an_unreadable_store_url_is_a_configuration_error(
    url: str, words: list[str]
) -> None:
    with pytest.raises(ConfigurationError) as info:
        store_for(url)
    text = str(info.value)
    assert all(word in text for word in words), text
    assert "secret" not in text


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("nats://h:abc", ["port 'abc'", "nats://host:4222"]),
        ("nats://h1:4222,h2:abc", ["port 'abc'"]),
        ("nats://u:secret@h:-1", ["port '-1'"]),
        ("kafka://h:abc", ["port 'abc'", "kafka://host:9092"]),
        ("kafka://h1:9092,h2:70000", ["port '70000'"]),
        ("nats://[::1", ["cannot be read"]),
        ("kafka://[::1", ["cannot be read"]),
    ],
)
def test_a_bad_port_or_an_unreadable_broker_url_is_a_configuration_error(
    url: str, words: list[str]
) -> None:
    from eventflow.brokers import open_broker

    with pytest.raises(ConfigurationError) as info:
        open_broker(url)
    text = str(info.value)
    assert all(word in text for word in words), text
    assert "secret" not in text


def test_good_hosts_and_ports_are_accepted() -> None:
    from eventflow.brokers import open_broker
    from eventflow.urls import split_url

    assert split_url("postgresql://u:p@[::1]:5432,h2/db", kind="PostgreSQL store").path == "/db"
    assert PostgresStore.from_url("postgresql://h1:5432,h2:5433/db").config.dsn.startswith(
        "postgresql://h1:5432,h2:5433/db"
    )
    open_broker("nats://h1:4222,h2")
    open_broker("kafka://h1:9092,h2:9093")
