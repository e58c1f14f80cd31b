"""The README's quick start runs as written and does what the README says it does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _block(language: str, index: int = 0) -> str:
    blocks = re.findall(rf"^```{language}\n(.*?)^```", README, re.M | re.S)
    assert len(blocks) > index, f"README has no ```{language} block #{index}"
    return str(blocks[index])


def test_readme_starts_with_the_two_commands() -> None:
    commands = [line.split("#")[0].strip() for line in _block("bash").splitlines()]
    assert commands == [
        "pip install -e . && eventflow demo",
        "pip install -e '.[test]' && python -m pytest -n 8",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^python -m pytest -n 8$", ci, re.M), ".ci/run must run the README's command"


def test_quick_start_runs_and_prints_what_the_readme_says(tmp_path: Path) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(_block("python"))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    promised = _block("text").strip().splitlines()
    assert proc.stdout.strip().splitlines() == promised
    assert (tmp_path / "shop.db").exists()  # the SQLite store it says it leaves behind


def test_event_store_example_runs(tmp_path: Path) -> None:
    script = tmp_path / "carts.py"
    script.write_text(_block("python", 1))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("1 cart-c-1 1 ")
    assert lines[-1] == "{'sku-1': 2}"
