"""`eventflow demo`: the summary, the invariant checks and the kept store."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eventflow.cli import main
from eventflow.cli._demo_services import InventoryService, OrderService
from eventflow.cli.demo import DemoResult, check


def _field(out: str, name: str) -> str:
    match = re.search(rf"^  {name}\s+(.*)$", out, re.M)
    assert match, f"no {name!r} line in:\n{out}"
    return match.group(1)


def test_demo_exits_0_and_prints_the_summary() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eventflow.cli", "demo", "--orders", "100"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert _field(out, "orders placed") == "100"
    assert _field(out, "duplicates sent") == "10 (skipped by dedup: 10)"
    reserved = int(_field(out, "stock reserved").split()[0])
    rejected = int(_field(out, "stock rejected").split()[0])
    assert reserved + rejected == 100 and rejected > 0
    assert int(_field(out, "orders confirmed")) == reserved
    assert int(_field(out, "orders rejected")) == rejected
    assert int(_field(out, "handler retries")) >= 1
    assert _field(out, "dead letters") == "1"
    assert "[demo-inventory] malformed: MalformedMessageError" in out
    assert re.search(r"elapsed\s+[\d.]+ s \([\d,]+ orders/s", out)
    assert out.count("  ok  ") == 6 and "FAIL" not in out
    assert "all checks passed" in out


def test_demo_keeps_its_store_with_db(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "demo.db"
    assert main(["demo", "--orders", "30", "--db", str(db)]) == 0
    assert "all checks passed" in capsys.readouterr().out
    url = f"sqlite:///{db}"
    assert main(["dlq", "list", "--store", url, "--json"]) == 0
    (letter,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (letter["group"], letter["topic"], letter["reason"], letter["attempts"]) == (
        "demo-inventory",
        "demo.order.placed",
        "malformed",
        0,
    )
    # a second run on the same file counts only its own dead letter
    assert main(["demo", "--orders", "10", "--db", str(db)]) == 0
    assert "exactly one dead letter (the poison message): 1 dead letter" in capsys.readouterr().out


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["demo", "--orders", "0"]) == 2
    assert "--orders must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--db", str(tmp_path / "missing" / "x.db")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_checks_name_what_failed() -> None:
    inventory = InventoryService({"sku": 1})
    inventory.handled.update({"o-00001": 2})  # handled twice: dedup did not work
    inventory.stock["sku"] = -1
    inventory.lowest = -1
    orders = OrderService({"o-00001": ["confirmed", "confirmed"]})
    result = DemoResult("sqlite:///x.db", 2, 1, 1, inventory, orders, {}, timed_out=True)
    failed = {c.name for c in check(result) if not c.ok}
    assert failed == {
        "all messages processed in time",
        "every order resolved exactly once",
        "duplicates handled once (dedup)",
        "reservations match confirmations",
        "stock never negative",
        "exactly one dead letter (the poison message)",
    }
