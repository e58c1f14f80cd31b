"""examples/shop/README.md, "Each service on its own": its blocks run as written, twice.

The first block (the exports, ``eventflow groups declare`` and the five services started
in the background) runs in ``bash`` as one script; once every service answers ``/readyz``,
the second block (the ``curl`` lines "from another terminal") runs, and each answer is
what the README promises: the order placed with ``?wait=5`` is completed, the stock and the
provider's charges show it. Then the services are stopped (SIGTERM to the script's process
group) and both blocks run again on the same broker and database: a second run finds the
order already placed (one order, one charge) and the stock seeded once.

Two things differ from a terminal, so that tests running side by side do not meet: the
broker is a nats-server of the test's own and the store a database of the test's own with
small pools (``?pool=4``: five processes share the server with the rest of the suite; the
URLs of the ``export`` lines are replaced), and every port the blocks name is replaced by
a free one (``SHOP_*_PORT`` say where the provider is, as they would for a user who moves
it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from eventflow.testing.nats_server import NatsServerUnavailable
from eventflow.testing.postgres import postgres_url
from eventflow.testing.services import free_port, service_unavailable
from examples.shop.catalog import CATALOG
from examples.shop.system import REPO, broker_server, drop_database, ensure_database

pytestmark = [
    pytest.mark.service("postgres"),
    pytest.mark.service("nats"),
    pytest.mark.slow,
    pytest.mark.timeout(180),
]

SKU_1 = CATALOG["sku-1"].initial_stock
SECTION = "Each service on its own (NATS or Kafka, PostgreSQL)"
README = REPO / "examples" / "shop" / "README.md"


def _blocks() -> list[str]:
    text = README.read_text()
    match = re.search(rf"^## {re.escape(SECTION)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section {SECTION!r} in {README}"
    blocks = re.findall(r"^```bash\n(.*?)^```", match.group(1), re.M | re.S)
    assert len(blocks) == 2, f"expected the services block and the curl block: {blocks}"
    return blocks


@pytest.fixture
async def own_servers() -> AsyncIterator[tuple[str, str]]:
    """(a nats-server's URL, a PostgreSQL database URL) of the test's own."""
    server = postgres_url().partition("?")[0].rsplit("/", 1)[0]
    store = f"{server}/ef_shop_{uuid.uuid4().hex[:12]}?pool=4"  # 5 processes beside the suite
    await ensure_database(store)
    try:
        try:
            async with broker_server("nats") as broker:
                yield broker, store
        except NatsServerUnavailable as exc:
            service_unavailable(f"the README's block needs a nats-server: {exc}")
    finally:
        await drop_database(store)


def _localize(block: str, broker: str, store: str, ports: dict[int, int]) -> str:
    """The block with the test's broker, store and ports in place of the README's."""
    block = re.sub(r"^export SHOP_BROKER=\S+", f"export SHOP_BROKER={broker}", block, flags=re.M)
    block = re.sub(r"^export SHOP_STORE=\S+", f"export SHOP_STORE={store}", block, flags=re.M)
    return re.sub(
        r"(--port |localhost:|127\.0\.0\.1:)(\d{4})\b",
        lambda m: m[1] + str(ports.get(int(m[2]), int(m[2]))),
        block,
    )


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def _ready(urls: list[str], proc: asyncio.subprocess.Process, log: Path) -> None:
    deadline = asyncio.get_running_loop().time() + 120
    async with httpx.AsyncClient(timeout=2.0) as client:
        for url in urls:
            while True:
                assert proc.returncode is None, f"the block ended: {_tail(log)}"
                try:
                    if (await client.get(f"{url}/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert asyncio.get_running_loop().time() < deadline, (
                    f"{url} not ready: {_tail(log)}"
                )
                await asyncio.sleep(0.2)


async def _bash(script: str, env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            f"set -e\n{script}\nwait",
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group: the services go with it
        )


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with_group = os.getpgid(proc.pid)
        os.killpg(with_group, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            os.killpg(with_group, signal.SIGKILL)
            await proc.wait()


async def test_each_service_on_its_own_runs_as_written_twice(
    own_servers: tuple[str, str], tmp_path: Path
) -> None:
    broker, store = own_servers
    services, curls = _blocks()
    named = sorted(
        {int(p) for p in re.findall(r"(?:--port |localhost:)(\d{4})\b", services + curls)}
    )
    ports = {port: free_port() for port in named}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOP_")}
    env |= {
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        "SHOP_ORDERS_PORT": str(ports[8000]),
        "SHOP_INVENTORY_PORT": str(ports[8001]),
        "SHOP_PROVIDER_PORT": str(ports[8002]),
    }
    started = re.findall(r"--port (\d{4})", services)
    urls = [f"http://127.0.0.1:{ports[int(p)]}" for p in started]
    for run in (1, 2):
        log = tmp_path / f"services-{run}.log"
        proc = await _bash(_localize(services, broker, store, ports), env, log)
        try:
            await _ready(urls, proc, log)
            lines = [line for line in curls.splitlines() if line.startswith("curl ")]
            answers = []
            for line in lines:
                out = await asyncio.create_subprocess_exec(
                    "bash",
                    "-c",
                    _localize(line, broker, store, ports),
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
                stdout, stderr = await out.communicate()
                assert out.returncode == 0, (line, stderr)
                answers.append(stdout.decode())
        finally:
            await _stop(proc)
        placed, one, completed, trace, stock, charges, ready = answers
        assert json.loads(placed)["status"] == "completed", (run, placed)
        assert json.loads(one)["status"] == "completed", one
        assert [o["order_id"] for o in json.loads(completed)["orders"]] == ["o-1"], completed
        assert json.loads(trace)["order_id"] == "o-1", trace
        assert json.loads(stock)["sku-1"] == {"on_hand": SKU_1 - 2, "reserved": 0}, (run, stock)
        charged = [c for c in json.loads(charges)["charges"] if c["order_id"] == "o-1"]
        assert len(charged) == 1 and not charged[0]["refunded"], (run, charges)
        assert json.loads(ready) == {"app": "shop-payments", "status": "ok", "problems": []}
