"""The README's quick start runs as written and does what the README says it does."""

from __future__ import annotations

import os
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


def test_event_store_example_runs_twice(tmp_path: Path) -> None:
    script = tmp_path / "carts.py"
    script.write_text(_block("python", 1))
    for run in (1, 2):  # the second run adds to the cart the first one saved
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert lines[0].startswith("1 cart-c-1 1 ")
        assert len(lines) == run + 1 and lines[run - 1].startswith(f"{run} cart-c-1 {run} ")
        assert lines[-1] == f"{{'sku-1': {2 * run}}}"


def test_command_line_block_runs_as_written_twice(tmp_path: Path) -> None:
    """From the repository root as the README says; here from a directory of the test's own
    holding the repository's schemas/ (the SQLite stores land in the current directory),
    with examples/ importable as `pip install -e .` makes it."""
    (block,) = re.findall(r"^## Command line\n.*?^```bash\n(.*?)^```", README, re.M | re.S)
    (tmp_path / "schemas").symlink_to(REPO / "schemas")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOP_")}
    env |= {"PYTHONPATH": str(REPO), "EVENTFLOW_PLAIN": "1"}
    for _ in range(2):
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        assert "o-2 compensated charge rejected (shop.payment.declined)" in out
        assert "order-o-1@1  shop.order.placed v2" in out
        assert "saga-order-o-1  order  o-1  completed" in out
        assert "schema check passed" in out and "stateDiagram-v2" in out
