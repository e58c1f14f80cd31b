"""Shared setup of the contract suites.

Each adapter module (``test_<adapter>_broker.py``) subclasses a contract from
``eventflow.testing`` and defines the ``broker_factory`` fixture it needs; the contracts
themselves need nothing else from here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest


@pytest.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves tasks running: components must own (and stop) their tasks."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)  # let cancelled tasks finish unwinding
    leaked = {t for t in asyncio.all_tasks() - before if not t.done()}
    leaked.discard(asyncio.current_task())  # type: ignore[arg-type]
    assert not leaked, f"tasks left running after the test: {leaked}"
