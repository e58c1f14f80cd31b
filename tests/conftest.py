"""Shared fixtures: unique in-memory brokers per test and a bounded polling helper.

Memory brokers opened with the same ``memory://NAME`` share a hub for as long as one of them
is open, so each test gets its own name; ``hub`` keeps a broker open on that name so that
messages survive between two app instances (a restart) within one test.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig

_names = itertools.count()

Condition = Callable[[], bool | Awaitable[bool]]


async def wait_until(condition: Condition, *, timeout: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` (sync or async) until it is true; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition!r}")
        await asyncio.sleep(0.005)


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
