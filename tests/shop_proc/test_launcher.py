"""``python -m examples.shop`` and ``python -m examples.shop.load`` as a user runs them.

The launcher starts its own nats-server and the five shop processes on a database of the
test's own, prints where each listens and stays up; a short load run against it places
orders and follows each to its final status with none lost; SIGINT (Ctrl-C) then stops
every process and the launcher exits 0, leaving no process of the shop behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eventflow.testing.nats_server import NatsServerUnavailable, find_nats_server
from eventflow.testing.postgres import postgres_url
from eventflow.testing.services import service_unavailable
from examples.shop.system import REPO, SERVICES, drop_database, ensure_database

pytestmark = [
    pytest.mark.service("postgres"),
    pytest.mark.service("nats"),
    pytest.mark.slow,
    pytest.mark.timeout(180),
]

READY_LINE = b"Ctrl-C stops everything."
LISTENING = re.compile(rb"^(\w+)\s+(http://127\.0\.0\.1:\d+)\s+pid (\d+)")


@pytest.fixture
async def launcher_store() -> AsyncIterator[str]:
    """A database of the test's own; the launcher creates it, the test drops it."""
    server = postgres_url().partition("?")[0].rsplit("/", 1)[0]
    url = f"{server}/ef_shop_{uuid.uuid4().hex[:12]}?pool=4"
    try:
        yield url
    finally:
        await drop_database(url)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_launcher_runs_the_shop_and_stops_it_on_ctrl_c(
    launcher_store: str, tmp_path: Path
) -> None:
    try:
        find_nats_server()
    except NatsServerUnavailable as exc:
        service_unavailable(f"the launcher starts a nats-server: {exc}")
    await ensure_database(launcher_store)  # (it would create it too; the drop is ours)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.shop",
        "--store",
        launcher_store,
        "--port-base",
        "0",
        "--logs",
        str(tmp_path / "logs"),
        "--set",
        "SHOP_SHIP_LATE=0",
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join((str(REPO), os.environ.get("PYTHONPATH", ""))),
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    printed: list[bytes] = []
    listening: dict[str, tuple[str, int]] = {}
    try:
        while not printed or printed[-1].strip() != READY_LINE:
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line, f"the launcher exited before it was ready: {b''.join(printed)!r}"
            printed.append(line)
        for match in filter(None, map(LISTENING.match, printed)):
            listening[match[1].decode()] = (match[2].decode(), int(match[3]))
        assert sorted(listening) == sorted(SERVICES), printed

        from examples.shop.load import run_load

        result = await run_load(listening["orders"][0], rate=20, duration=2, seed=5, settle=60)
        assert result.sent == result.accepted == 40, result
        assert not result.refused and not result.lost, result
        assert sum(result.statuses.values()) == 40 and len(result.latencies) == 40, result
    finally:
        proc.send_signal(signal.SIGINT)
        rest = await asyncio.wait_for(proc.stdout.read(), 90)
        code = await proc.wait()
    assert code == 0, (b"".join(printed) + rest).decode()
    assert b"stopped: " in rest, rest
    left = [name for name, (_, pid) in listening.items() if _alive(pid)]
    assert not left, f"still running after the launcher exited: {left}"
