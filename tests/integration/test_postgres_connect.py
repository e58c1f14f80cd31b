"""Connecting to PostgreSQL: a server that is not there, or that never answers, fails
``store.open()`` within ``connect_timeout`` with a StoreError that names the URL without its
password; the URL's driver options reach the server unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from eventflow import StoreError
from eventflow.adapters.postgres import PostgresStore
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url
from eventflow.testing.services import free_port


def _store(url: str) -> PostgresStore:
    store = store_for(url)
    assert isinstance(store, PostgresStore)
    return store


async def _open_failure(store: PostgresStore) -> tuple[StoreError, float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(StoreError) as info:
            await store.open()
    finally:
        await store.close()
    return info.value, loop.time() - started


async def test_nothing_listening_fails_at_once_naming_the_url_without_password() -> None:
    port = free_port()
    store = _store(f"postgresql://app:s3cret@127.0.0.1:{port}/shop?connect_timeout=5")
    error, took = await _open_failure(store)
    text = str(error)
    assert f"127.0.0.1:{port}" in text
    assert "app:***@" in text
    assert "s3cret" not in text
    assert "check that the server runs" in text
    assert took < 5.0  # refused: no need to wait for the timeout


@pytest.fixture
async def silent_server() -> AsyncIterator[tuple[int, list[asyncio.StreamWriter]]]:
    """A TCP server that accepts connections and never says a word."""
    accepted: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # keep it open, answer nothing

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, accepted
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_server_that_never_answers_fails_within_connect_timeout(
    silent_server: tuple[int, list[asyncio.StreamWriter]],
) -> None:
    port, accepted = silent_server
    store = _store(f"postgresql://app:s3cret@127.0.0.1:{port}/shop?connect_timeout=0.5")
    error, took = await _open_failure(store)
    assert accepted  # the connection was taken, so the wait was for an answer
    text = str(error)
    assert "did not answer within 0.5 s" in text
    assert "connect_timeout" in text
    assert f"127.0.0.1:{port}" in text
    assert "s3cret" not in text
    assert 0.4 <= took < 3.0, took  # asyncpg's own default would wait 60 s


@pytest.mark.service("postgres")
async def test_driver_options_and_connect_timeout_reach_a_real_server() -> None:
    async with isolated_schema(postgres_url()) as url:
        store = _store(f"{url}&connect_timeout=5&application_name=ef-it-connect&sslmode=disable")
        assert store.config.connect_timeout == 5.0
        await store.open()
        try:
            async with store.db.connection() as conn:
                assert await conn.fetchval("SHOW application_name") == "ef-it-connect"
                assert await conn.fetchval("SHOW search_path") == store.config.schema
        finally:
            await store.close()
