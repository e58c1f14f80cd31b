"""Shared fixtures: unique in-memory brokers per test, a bounded polling helper, and a check
that no test leaves a task running. The servers (``nats_url``, ``kafka_url``, a
``postgres_url`` schema per test) and ``make_app`` come from the plugin the package ships,
``eventflow.testing.plugin``, as users get them.

Memory brokers opened with the same ``memory://NAME`` share a hub for as long as one of them
is open, so each test gets its own name; ``hub`` keeps a broker open on that name so that
messages survive between two app instances (a restart) within one test.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig
from eventflow.testing.waiting import eventually

_names = itertools.count()
_PLUGIN = "eventflow.testing.plugin"

Condition = Callable[[], bool | Awaitable[bool]]


def pytest_configure(config: pytest.Config) -> None:
    """Load the package's pytest plugin, unless its entry point already did (an install made
    before the entry point existed, or ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``, does not)."""
    plugins = config.pluginmanager
    if not plugins.has_plugin("eventflow") and not plugins.has_plugin(_PLUGIN):
        plugins.import_plugin(_PLUGIN)


async def wait_until(condition: Condition, *, timeout: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` (sync or async) until it is true; fail the test after ``timeout``
    with its last value (``eventflow.testing.eventually``)."""
    await eventually(condition, timeout, interval=0.005, message=what)


async def _check_no_leaked_tasks(before: set[asyncio.Task[object]]) -> None:
    """Fail if tasks started since ``before`` are still running."""
    await asyncio.sleep(0)  # let cancelled tasks finish unwinding
    leaked = {t for t in asyncio.all_tasks() - before if not t.done()}
    leaked.discard(asyncio.current_task())  # type: ignore[arg-type]
    assert not leaked, f"tasks left running after the test: {leaked}"


@pytest.fixture
async def _leak_check() -> AsyncIterator[None]:
    """The leak check of one async test, in the test's own event loop."""
    before = asyncio.all_tasks()
    yield
    await _check_no_leaked_tasks(before)


@pytest.fixture(autouse=True)
def _no_leaked_tasks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test that leaves tasks running: components must own (and stop) their
    tasks. Every test package gets it from here; a sync test has no loop to leak into.

    Autouse fixtures are set up first and torn down last, so the check runs after every
    other fixture of the test has closed what it started."""
    if inspect.iscoroutinefunction(getattr(request.node, "obj", None)):
        request.getfixturevalue("_leak_check")
    yield


@pytest.fixture
def waiter() -> Callable[..., Awaitable[None]]:
    """The bounded polling helper, as a fixture (test modules do not import conftest)."""
    return wait_until


@pytest.fixture
def broker_name(request: pytest.FixtureRequest) -> str:
    """A memory hub name no other test uses."""
    label = re.sub(r"[^A-Za-z0-9_-]", "_", request.node.name)[:40]
    return f"t{os.getpid()}-{next(_names)}-{label}"


@pytest.fixture
def broker_url(broker_name: str) -> str:
    """``memory://<unique name>``."""
    return f"memory://{broker_name}"


@pytest.fixture
async def hub(broker_name: str) -> AsyncIterator[MemoryBroker]:
    """A started broker on the test's hub: keeps the hub (and its queues) alive all test long,
    and lets the test inspect group sizes (unacked messages)."""
    broker = MemoryBroker(MemoryBrokerConfig(name=broker_name))
    await broker.start()
    try:
        yield broker
    finally:
        await broker.close()
