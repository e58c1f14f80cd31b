"""``eventflow store init|read|tail`` against a SQLite store."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from eventflow import Event, open_store
from eventflow.cli import main


class CliStoreItem(Event, type="cli.store.item"):
    """A test event."""

    n: int


def _fill(url: str) -> None:
    async def run() -> None:
        async with open_store(url) as store:
            await store.append("item-1", [CliStoreItem(n=1), CliStoreItem(n=2)])
            await store.append("item-2", [CliStoreItem(n=3)])

    asyncio.run(run())


def test_init_creates_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    assert main(["store", "init", "--store", url]) == 0
    assert (tmp_path / "new.db").exists()
    assert "store ready" in capsys.readouterr().out


def test_read_stream_all_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    _fill(url)
    assert main(["store", "read", "item-1", "--store", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["item-1@1", "item-1@2"]
    assert main(["store", "read", "item-1", "--backwards", "--store", url]) == 0
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == [
        "item-1@2",
        "item-1@1",
    ]
    assert main(["store", "read", "--all", "--after", "1", "--json", "--store", url]) == 0
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["position"] for r in rows] == [2, 3]
    assert rows[1]["envelope"]["data"] == {"n": 3}


def test_read_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    _fill(url)
    assert main(["store", "read", "nope", "--store", url]) == 1
    assert "no events" in capsys.readouterr().err
    assert main(["store", "read", "--store", url]) == 2
    assert main(["store", "read", "item-1", "--store", f"sqlite:///{tmp_path / 'x.db'}"]) == 2


def test_tail_follows_new_events(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    _fill(url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "eventflow.cli", "store", "tail", "--store", url, "--after", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert "item-2@1" in first
        time.sleep(0.2)

        async def more() -> None:
            async with open_store(url) as store:
                await store.append("item-3", [CliStoreItem(n=4)])

        asyncio.run(more())
        assert "item-3@1" in proc.stdout.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
