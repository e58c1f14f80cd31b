"""examples/shop/README.md: the blocks of the embedded form run as written, twice, and print
what the README says. (The blocks that start the services as separate processes are run by
tests/shop_proc.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "examples" / "shop" / "README.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"no section {title!r} in examples/shop/README.md"
    return match.group(1)


def _blocks(title: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", _section(title), re.M | re.S)


@pytest.fixture
def env() -> dict[str, str]:
    """The environment of a user who installed eventflow from the repository (examples/ is
    packaged), with no SHOP_* variable set: the defaults."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHOP_")}
    return {**clean, "PYTHONPATH": str(REPO), "EVENTFLOW_PLAIN": "1"}


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_embedded_form_and_looking_at_it(tmp_path: Path, env: dict[str, str]) -> None:
    (together,) = _blocks("The embedded form: everything in one process", "bash")
    (printed,) = _blocks("The embedded form: everything in one process", "text")
    (looking,) = _blocks("Looking at it", "bash")
    for _ in range(2):
        out = _run(["bash", "-euo", "pipefail", "-c", together], tmp_path, env)
        assert out == printed
        out = _run(["bash", "-euo", "pipefail", "-c", looking], tmp_path, env)
        assert "order-o-1@1  shop.order.placed v2" in out
        assert "saga-order-o-2  order  o-2  compensated" in out
        assert "reason:      charge rejected (shop.payment.declined)" in out
        assert "saga transition  compensation-sent reserve  shop.stock.release" in out
        assert "stock_levels" in out and "no dead letters" in out
        assert "stateDiagram-v2" in out
    assert sorted(p.name for p in tmp_path.glob("shop-*.db")) == [
        f"shop-{name}.db" for name in ("inventory", "orders", "payments", "provider", "shipping")
    ]


def test_a_publisher_only_process(tmp_path: Path, env: dict[str, str]) -> None:
    (code,) = _blocks("The embedded form: everything in one process", "python")
    (tmp_path / "backoffice.py").write_text(code)
    first = _run([sys.executable, "backoffice.py"], tmp_path, env).splitlines()
    assert first[0] == "202 pending" and first[1] in ("200 compensated", "200 completed")
    again = _run([sys.executable, "backoffice.py"], tmp_path, env).splitlines()
    ended = first[1].split()[1]
    assert again == [f"202 {ended}", f"200 {ended}"]  # the same order, known


def test_one_orders_trace(tmp_path: Path, env: dict[str, str]) -> None:
    (code,) = _blocks("Seeing it: traces and metrics", "python")
    (printed,) = _blocks("Seeing it: traces and metrics", "text")
    (tmp_path / "trace_one.py").write_text(code)
    shown = [line for line in printed.splitlines() if line.strip() != "..."]
    # The printed tree is that of an order shipped in time. The block's order id is new at
    # each run, and one in 20 (SHOP_SHIP_LATE) ships late: the ship step's retry, sent by
    # the saga's timer, then ends the order in another trace, as the README says, and the
    # tree misses its last line (one run in ten failed so).
    on_time = {**env, "SHOP_SHIP_LATE": "0"}
    for _ in range(2):
        out = _run([sys.executable, "trace_one.py"], tmp_path, on_time).splitlines()
        at = 0
        for line in shown:  # in this order, at this depth
            assert line in out[at:], f"{line!r} not in the trace after line {at}:\n" + "\n".join(
                out
            )
            at = out.index(line, at) + 1


def test_prometheus_scrapes_the_ports_the_services_are_started_on() -> None:
    (scrape,) = _blocks("Seeing it: traces and metrics", "yaml")
    targets = re.findall(r'"127\.0\.0\.1:(\d+)"', scrape)
    run = _blocks("Each service on its own (NATS or Kafka, PostgreSQL)", "bash")[0]
    orders = re.search(r"uvicorn examples\.shop\.orders:http --port (\d+)", run)
    inventory = re.search(r"uvicorn examples\.shop\.inventory:http --port (\d+)", run)
    payments = re.search(r"eventflow run examples\.shop\.payments:app --port (\d+)", run)
    shipping = re.search(r"eventflow run examples\.shop\.shipping:app --port (\d+)", run)
    assert orders and inventory and payments and shipping
    assert targets == [m.group(1) for m in (orders, inventory, payments, shipping)]
