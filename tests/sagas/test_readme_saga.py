"""The README's saga example runs as written and prints what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from eventflow.cli import main

REPO = Path(__file__).resolve().parents[2]


def _section(title: str) -> str:
    readme = (REPO / "README.md").read_text()
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", readme, re.M | re.S)
    assert found, f"README has no '## {title}' section"
    return found.group(1)


def _block(text: str, language: str) -> str:
    blocks = re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)
    assert blocks, f"the section has no ```{language} block"
    return str(blocks[0])


def test_the_saga_example_runs_and_prints_what_the_readme_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    section = _section("Sagas")
    script = tmp_path / "saga_example.py"
    script.write_text(_block(section, "python"))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == _block(section, "text").strip().splitlines()

    # The store it leaves behind answers the commands the section shows.
    url = f"sqlite:///{tmp_path / 'sagas.db'}"
    assert main(["sagas", "list", "--store", url]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert sorted((r[0], r[3]) for r in rows) == [
        ("saga-order-o-1", "completed"),
        ("saga-order-o-2", "compensated"),
    ]
    assert main(["sagas", "show", "saga-order-o-2", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "reason:      charge rejected (shop.payment.declined)" in out
    assert "compensation-sent  reserve  shop.stock.release (attempt 1)" in out
