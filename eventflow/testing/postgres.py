"""A PostgreSQL server for tests, and an isolated schema per test.

:func:`postgres_url` finds a server once per process, in this order:

1. the URL in ``EVENTFLOW_TEST_POSTGRES_URL`` (it must answer: a named server that is down
   fails the test);
2. ``postgresql://postgres@127.0.0.1:5432/test``, if it answers;
3. a throw-away ``postgres:15`` container started with testcontainers, if Docker answers
   (stopped when the process exits);
4. otherwise the test is skipped, naming what was tried; under CI (``CI=true``) it fails
   instead, so PostgreSQL tests never silently stop running there.

:func:`isolated_schema` creates an empty schema with a unique name and yields the URL with
``?schema=NAME``, which the PostgreSQL store adapter uses for all its tables, so tests
sharing one server do not see each other's events; the schema is dropped afterwards::

    @pytest.fixture
    async def store_url() -> AsyncIterator[str]:
        async with isolated_schema(postgres_url()) as url:
            yield url

The driver (asyncpg, the ``postgres`` extra) is imported only when a schema is created.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import os
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from .services import in_ci

__all__ = [
    "DEFAULT_URL",
    "ENV_VAR",
    "in_ci",
    "isolated_schema",
    "postgres_url",
    "with_schema",
]

ENV_VAR = "EVENTFLOW_TEST_POSTGRES_URL"
"""Environment variable naming the PostgreSQL server tests use."""
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
"""The server tried when ``EVENTFLOW_TEST_POSTGRES_URL`` is not set."""
CONNECT_TIMEOUT = 3.0
"""Seconds to wait for a server to answer a probe."""
CONTAINER_IMAGE = "postgres:15-alpine"

_lock = threading.Lock()
_resolved: tuple[str | None, str] | None = None  # (url, why not) once resolved


def _asyncpg() -> Any:
    try:
        return importlib.import_module("asyncpg")
    except ImportError as exc:
        raise ImportError(
            "PostgreSQL tests need asyncpg: pip install 'eventflow[postgres]'"
        ) from exc


def _admin_dsn(url: str) -> str:
    """``url`` without its query: eventflow options such as ``schema`` mean nothing to asyncpg."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def _probe(url: str) -> str | None:
    """Connect once and run ``SELECT 1``; return None if it worked, else why not.

    Runs its own event loop on a thread, so it works with or without a running loop.
    """

    async def attempt() -> None:
        conn = await _asyncpg().connect(_admin_dsn(url), timeout=CONNECT_TIMEOUT)
        try:
            await conn.fetchval("SELECT 1")
        finally:
            await conn.close()

    outcome: list[str | None] = []

    def run() -> None:
        try:
            asyncio.run(asyncio.wait_for(attempt(), CONNECT_TIMEOUT * 2))
            outcome.append(None)
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, name="eventflow-postgres-probe", daemon=True)
    thread.start()
    thread.join(CONNECT_TIMEOUT * 3)
    return outcome[0] if outcome else "no answer"


def _from_container() -> tuple[str | None, str]:
    """Start a PostgreSQL container if Docker answers; return (url, why not)."""
    try:
        docker = importlib.import_module("docker")
        docker.from_env().ping()
    except Exception as exc:
        return None, f"Docker does not answer ({type(exc).__name__}: {exc})"
    try:
        module = importlib.import_module("testcontainers.community.postgres")
    except ImportError:
        try:
            module = importlib.import_module("testcontainers.postgres")
        except ImportError:
            return None, "testcontainers is not installed (pip install testcontainers)"
    container = module.PostgresContainer(CONTAINER_IMAGE, driver=None)
    try:
        container.start()
    except Exception as exc:
        return None, f"could not start a {CONTAINER_IMAGE} container: {exc}"
    atexit.register(container.stop)
    url = str(container.get_connection_url())
    problem = _probe(url)
    return (url, "") if problem is None else (None, f"container at {url}: {problem}")


def _resolve() -> tuple[str | None, str]:
    configured = os.environ.get(ENV_VAR)
    if configured:
        problem = _probe(configured)
        if problem is not None:
            return None, f"{ENV_VAR}={_admin_dsn(configured)} does not answer: {problem}"
        return configured, ""
    problem = _probe(DEFAULT_URL)
    if problem is None:
        return DEFAULT_URL, ""
    url, why = _from_container()
    if url is not None:
        return url, ""
    return None, (
        f"no PostgreSQL server: {ENV_VAR} is not set, {DEFAULT_URL} does not answer "
        f"({problem}), and {why}"
    )


def postgres_url() -> str:
    """The URL of a PostgreSQL server for tests, found once per process (see module doc).

    Skips the calling test when there is none, or fails it under CI or when
    ``EVENTFLOW_TEST_POSTGRES_URL`` names a server that does not answer.
    """
    global _resolved
    with _lock:
        if _resolved is None:
            _resolved = _resolve()
        url, why = _resolved
    if url is not None:
        return url
    if in_ci() or os.environ.get(ENV_VAR):
        pytest.fail(f"PostgreSQL tests cannot run: {why}", pytrace=False)
    pytest.skip(f"PostgreSQL tests skipped: {why}")


def with_schema(url: str, schema: str) -> str:
    """``url`` with its ``schema`` query option set to ``schema``."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "schema"]
    query.append(("schema", schema))
    return urlunsplit(parts._replace(query=urlencode(query)))


@asynccontextmanager
async def isolated_schema(url: str, *, prefix: str = "ef_test_") -> AsyncIterator[str]:
    """Create an empty schema with a unique name, yield ``url?schema=NAME``, then drop it.

    Close every store using the schema before leaving the block: the drop waits for their
    locks.
    """
    name = f"{prefix}{uuid.uuid4().hex[:16]}"
    dsn = _admin_dsn(url)
    asyncpg = _asyncpg()
    conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT)
    try:
        await conn.execute(f'CREATE SCHEMA "{name}"')
    finally:
        await conn.close()
    try:
        yield with_schema(url, name)
    finally:
        conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        finally:
            await conn.close()
