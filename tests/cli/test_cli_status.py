"""`eventflow status`: instances from the heartbeats table and DLQ counts per group."""

from __future__ import annotations

import json

import pytest
from cli_support import fill, make_beat

from eventflow.cli import main


def test_status_lists_instances_and_dead_letters(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(store_url, beats=[make_beat("billing", age=1.0), make_beat("shipping", age=300.0)])
    assert main(["status", "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert "app instances: 1 running, 1 stale" in out
    billing = next(line for line in out.splitlines() if "billing@host:42:abc" in line)
    assert "billing:invoice.*" in billing
    assert "handled=10 duplicates=2" in billing and "retries" not in billing  # zeros hidden
    shipping = next(line for line in out.splitlines() if "shipping@host:42:abc" in line)
    assert "5m stale" in shipping
    assert "dead letters: 3" in out
    counts = {
        line.split()[0]: line.split()[1]
        for line in out.split("dead letters: 3", 1)[1].splitlines()
        if line.strip() and not line.strip().startswith(("GROUP", "inspect"))
    }
    assert counts == {"billing": "2", "shipping": "1"}


def test_status_json(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    fill(store_url, beats=[make_beat("billing", age=2.0)])
    assert main(["status", "--store", store_url, "--json", "--stale", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dead_letters"] == {"billing": 2, "shipping": 1}
    (inst,) = data["instances"]
    assert inst["app"] == "billing" and inst["pid"] == 42
    assert inst["stale"] is True and inst["age_seconds"] >= 2.0
    assert inst["subscriptions"] == ["billing:invoice.*"]
    assert inst["stats"]["handled"] == 10


def test_status_of_an_idle_store(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/idle.db"
    fill(url)
    assert main(["status", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "app instances: 0 running" in out
    assert "no app is running against this store" in out
    assert "dead letters: 0" in out


def test_status_needs_a_store(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EVENTFLOW_STORE", raising=False)
    assert main(["status"]) == 2
    assert "no store given" in capsys.readouterr().err
