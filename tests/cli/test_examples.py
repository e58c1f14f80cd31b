"""The shop example runs as its README says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_place_orders_settles_every_order(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "examples.shop.place_orders", "--orders", "40"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"placed 40 orders: (\d+) confirmed, (\d+) rejected", proc.stdout)
    assert match, proc.stdout
    confirmed, rejected = int(match[1]), int(match[2])
    assert confirmed + rejected == 40 and confirmed > 0 and rejected > 0
    left = dict(re.findall(r"(sku-\w+)=(-?\d+)", proc.stdout))
    assert left and all(int(n) >= 0 for n in left.values())
    assert (tmp_path / "shop.db").exists()  # App(store="sqlite:///shop.db"), relative to cwd
    readme = (REPO / "examples" / "shop" / "README.md").read_text()
    shown = re.sub(r"\d+", "N", proc.stdout.splitlines()[0])
    assert shown in re.sub(r"\d+", "N", readme)  # the README shows this output
