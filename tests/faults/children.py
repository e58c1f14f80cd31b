"""Child processes of the fault tests, both sides of the ``ready`` handshake.

In the test: :func:`launch` starts ``python SCRIPT ARGS...`` on this checkout and waits for
the child's first line, ``ready`` (:func:`spawn` and :func:`until_ready` when something must
happen in between); :class:`Child` signals, kills and stops it. In the child script:
:func:`serve` runs its app until SIGTERM, printing ``ready`` once the app is live.

A child runs with this checkout and ``tests/`` on ``PYTHONPATH``, so that a script of this
folder imports ``faults.children`` as the tests do (run one by hand the same way:
``PYTHONPATH=.:tests python tests/faults/hop_member.py ...``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from eventflow import App

__all__ = ["CHILD_POOL", "Child", "child_store", "launch", "serve", "spawn", "until_ready"]

REPO = Path(__file__).parents[2]
_PYTHONPATH = os.pathsep.join((str(REPO), str(REPO / "tests")))

CHILD_POOL = 4
"""Connections at most in a child's PostgreSQL pool. The suite's processes share one server
and its 100 clients: with the default pool of 10, at the suite's peak under `pytest -n 8` (97
clients in a sample) the limit members of one test held 32 and the saga apps of another 23;
with 4 for both, the peak sampled was 67. The saga apps (``saga_app.py``) keep the default:
with 4, a process whose saga handlers waited on the row locks of a SIGSTOPped one had no
connection left to take the timer lease over (1 of 4 runs of
``test_saga_timers_two_processes``; 0 of 5 with 10)."""


def child_store(url: str) -> str:
    """``url`` as a child process's store: a PostgreSQL URL with a pool of at most
    :data:`CHILD_POOL` unless it names its own, any other URL (``memory://``) as it is."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("postgres"):
        return url
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "pool" for key, _ in query):
        return url
    return urlunsplit(parts._replace(query=urlencode([*query, ("pool", str(CHILD_POOL))])))


async def spawn(script: str | Path, *args: str) -> asyncio.subprocess.Process:
    """Start ``python SCRIPT ARGS...`` on this checkout, its stdout piped (for the ``ready``
    line and whatever the child prints after it)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": _PYTHONPATH},
    )


async def until_ready(proc: asyncio.subprocess.Process, what: str, timeout: float = 60) -> None:
    """Wait up to ``timeout`` seconds for the child's first line, which must be ``ready``;
    else an ``AssertionError`` saying that ``what`` did not start."""
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    assert line.strip() == b"ready", f"{what} did not start: {line!r}"


async def launch(
    script: str | Path, *args: str, what: str, timeout: float = 60
) -> asyncio.subprocess.Process:
    """:func:`spawn` the child and wait :func:`until_ready`."""
    proc = await spawn(script, *args)
    await until_ready(proc, what, timeout)
    return proc


class Child:
    """A child process started with :func:`launch`."""

    stop_within = 30.0
    """Seconds :meth:`stop` waits for the child to exit after SIGTERM."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    def signal(self, sig: int) -> None:
        """Send ``sig`` if it still runs."""
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def kill(self) -> None:
        """SIGKILL it and reap it."""
        self.signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        """SIGTERM it and wait for it to exit."""
        self.signal(signal.SIGTERM)
        await asyncio.wait_for(self.proc.wait(), self.stop_within)


async def serve(app: App, *, ready: Callable[[], Awaitable[bool]] | None = None) -> None:
    """In the child: run ``app`` until SIGTERM (then a graceful stop), printing ``ready`` once
    it is live and, given ``ready``, once that says True (asked every 10 ms)."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with app:
        while ready is not None and not await ready():
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        await stop.wait()
