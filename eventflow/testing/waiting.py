"""``eventually``: wait until a condition holds, or fail with the last value it returned.

The one waiting helper of the test kit: the contract suites, the pytest plugin
(``eventflow.testing.plugin``) and this project's own tests use it. This module imports
nothing but the standard library.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

__all__ = ["DEFAULT_INTERVAL", "DEFAULT_TIMEOUT", "eventually"]

DEFAULT_TIMEOUT = 5.0
"""Seconds ``eventually`` waits by default."""
DEFAULT_INTERVAL = 0.01
"""Seconds between two looks at the condition."""


async def eventually(
    condition: Callable[[], object],
    timeout: float = DEFAULT_TIMEOUT,
    *,
    interval: float = DEFAULT_INTERVAL,
    message: str = "",
) -> object:
    """Call ``condition()`` (sync, or returning an awaitable) until its value is truthy and
    return that value; after ``timeout`` seconds raise ``AssertionError`` with the last
    value it returned.

    A condition that raises ``AssertionError`` (an ``assert`` inside a lambda's helper)
    counts as not holding yet; the last such error is what the failure reports. Any other
    exception propagates at once. ``message`` names the condition in the failure (its
    ``repr`` by default)::

        await eventually(lambda: len(seen) == 3)
        await eventually(lambda: app.dead_letters.list(), message="a dead letter")
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
        except AssertionError as exc:
            value = exc
        else:
            if value:
                return value
        if loop.time() >= deadline:
            what = message or repr(condition)
            last = (
                f"{type(value).__name__}: {value}"
                if isinstance(value, BaseException)
                else repr(value)
            )
            raise AssertionError(
                f"{what} did not hold within {timeout:g}s; last value: {last}"
            ) from (value if isinstance(value, BaseException) else None)
        await asyncio.sleep(interval)
