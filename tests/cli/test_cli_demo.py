"""`eventflow demo`: the shop in one process, its summary, the invariant checks."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from eventflow.cli import main
from eventflow.cli._demo_run import DemoResult, Planned
from eventflow.cli.demo import NO_HTTP, check
from eventflow.ports import DeadLetter

REPO = Path(__file__).resolve().parents[2]
ORDERS = 60

# Runs the demo with FastAPI, httpx and Starlette unimportable: the core dependencies only.
_CORE_ONLY = (
    "import sys\n"
    "for name in ('fastapi', 'httpx', 'starlette', 'uvicorn'):\n"
    "    sys.modules[name] = None\n"
    "from eventflow.cli import main\n"
    f"sys.exit(main(['demo', '--orders', '{ORDERS}']))\n"
)


def _field(out: str, name: str) -> str:
    match = re.search(rf"^  {re.escape(name)}\s+(.*)$", out, re.M)
    assert match, f"no {name!r} line in:\n{out}"
    return match.group(1)


def _demo(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def _assert_summary(out: str) -> None:
    assert _field(out, "orders placed") == str(ORDERS)
    assert _field(out, "posted twice") == f"{ORDERS // 10} (one order each)"
    completed = int(_field(out, "final: completed"))
    compensated = int(_field(out, "final: compensated"))
    assert completed + compensated == ORDERS and completed > 0 and compensated > 0
    assert _field(out, "final: pending") == "0" and _field(out, "final: failed") == "0"
    assert _field(out, "dead letters") == "1"
    assert "[shop-inventory] malformed: MalformedMessageError" in out
    assert re.search(r"the causal tree of compensated order demo-\w+-\d+", out)
    assert "saga transition  compensation-sent reserve  shop.stock.release" in out
    assert out.count("  ok    ") == 7 and "FAIL" not in out
    assert "all checks passed" in out


def test_demo_runs_the_shop_over_its_http_api() -> None:
    proc = _demo(["-m", "eventflow.cli", "demo", "--orders", str(ORDERS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "orders placed through the HTTP API in-process" in proc.stdout
    assert NO_HTTP not in proc.stdout
    _assert_summary(proc.stdout)


def test_demo_on_the_core_dependencies_calls_the_route_functions() -> None:
    proc = _demo(["-c", _CORE_ONLY])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == NO_HTTP  # said once, in one line
    assert "orders placed through the route functions (no FastAPI)" in proc.stdout
    _assert_summary(proc.stdout)


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--orders", "0"]) == 2
    assert "--orders must be at least 1" in capsys.readouterr().err


def test_checks_name_what_failed() -> None:
    ok = Planned("o-1", {"lines": [{"sku": "sku-1", "qty": 2}]}, "ok")
    declined = Planned("o-2", {"lines": [{"sku": "sku-3", "qty": 5}]}, "declined")
    result = DemoResult("sqlite:///x.db", "memory://", True, [ok, declined], timed_out=True)
    result.final = {"o-1": {"status": "completed"}, "o-2": {"status": "completed"}}
    result.stock_before = {"sku-1": {"on_hand": 10, "reserved": 0}}
    result.stock_after = {"sku-1": {"on_hand": 10, "reserved": 2}}  # not deducted, still held
    result.lowest_available = {"sku-1": -1}
    result.releases = Counter({("o-2", "sku-3"): 2})  # released twice, never held
    result.charges = [{"order_id": "o-1", "refunded": False}] * 2  # charged twice
    result.sagas = 3
    letter = DeadLetter("d-1", "t", "g", b"", "boom", 5, datetime.now(UTC))
    result.dead_letters = [letter, letter]
    assert {c.name for c in check(result) if not c.ok} == {
        "every order ended in time",
        "every order ended as its input dictates (completed or compensated)",
        "one order and one saga per order id (duplicate posts)",
        "stock never negative; on hand = before - sold, nothing left reserved",
        "each compensation once (nothing released twice or unheld, nothing left held)",
        "completed orders charged once and shipped once; compensated ones neither",
        "exactly one dead letter (the poison message)",
    }
