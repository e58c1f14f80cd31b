"""`eventflow dlq list|show|replay|purge` against a SQLite store filled through the store API."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_support import fill, letter_ids, make_letter

from eventflow.cli import main


def test_list_shows_every_letter_oldest_first(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "list", "--store", store_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["ID", "GROUP", "TOPIC", "REASON"]
    assert [line.split()[0] for line in out[1:]] == ["dl-1", "dl-2", "dl-3"]
    assert "ValueError: amount 1 is negative" in out[1]
    assert "Traceback" not in "\n".join(out)  # only the first line of the error


def test_list_filters_by_group_and_prints_json(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "list", "--store", store_url, "--group", "shipping", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["id"], r["group"], r["attempts"]) for r in rows] == [("dl-3", "shipping", 3)]


def test_store_comes_from_environment(
    store_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EVENTFLOW_STORE", store_url)
    assert main(["dlq", "list", "--limit", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("dl-1")


def test_list_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli_support import fill

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    fill(url)
    assert main(["dlq", "list", "--store", url]) == 0
    assert "no dead letters" in capsys.readouterr().out


def test_show_prints_the_whole_letter(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dlq", "show", "dl-2", "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert "id:          dl-2" in out
    assert "key:         inv-2" in out
    assert "Traceback (most recent call last)" in out  # the full error text
    assert '"type": "invoice.created"' in out  # the JSON payload, pretty-printed
    assert main(["dlq", "show", "dl-2", "--store", store_url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["payload"].startswith('{"id": "e-2"')
    assert data["source"] == {"partition": 1, "offset": 2}


def test_show_unknown_id_is_a_clear_error(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "show", "nope", "--store", store_url]) == 1
    err = capsys.readouterr().err
    assert "no dead letter 'nope'" in err
    assert "Traceback" not in err


def test_purge_by_id_and_all(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dlq", "purge", "dl-1", "dl-3", "--store", store_url]) == 0
    assert "purged 2 dead letters" in capsys.readouterr().out
    assert letter_ids(store_url) == ["dl-2"]
    assert main(["dlq", "purge", "--all", "--store", store_url]) == 0
    assert "purged 1 dead letter" in capsys.readouterr().out
    assert letter_ids(store_url) == []


def test_purge_with_an_unknown_id_deletes_nothing(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "purge", "dl-1", "missing", "--store", store_url]) == 1
    assert "no dead letter 'missing'" in capsys.readouterr().err
    assert letter_ids(store_url) == ["dl-1", "dl-2", "dl-3"]


@pytest.mark.parametrize("argv", [["dlq", "purge"], ["dlq", "purge", "dl-1", "--all"]])
def test_purge_needs_ids_or_all(
    store_url: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--store", store_url]) == 2
    assert "name the letters" in capsys.readouterr().err
    assert len(letter_ids(store_url)) == 3


def test_replay_over_memory_broker_explains_why_not(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "replay", "dl-1", "--store", store_url]) == 2
    err = capsys.readouterr().err
    assert "lives inside the app's process" in err
    assert "--app" in err and "app.dead_letters.replay" in err
    assert len(letter_ids(store_url)) == 3  # nothing was removed


def test_replay_with_app_uses_the_apps_broker_and_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'svc.db'}"
    from cli_support import fill

    fill(url, [make_letter(1), make_letter(2, group="not-mine")])
    module = "replay_target_app"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            from eventflow import App, Envelope, subscribe

            class RecordingBroker:
                # A broker adapter that keeps what it is given (the app never starts here).
                def __init__(self):
                    self.sent = []
                async def start(self): pass
                async def close(self): pass
                async def publish(self, topic, payload, *, key=None, headers=None):
                    self.sent.append((topic, payload, key, dict(headers or {{}})))
                async def subscribe(self, pattern, *, group):
                    raise NotImplementedError

            @subscribe("invoice.created", group="billing")
            async def bill(env: Envelope) -> None: ...

            app = App("billing-svc", broker=RecordingBroker(), store={url!r}, handlers=[bill])
            """
        )
    )
    argv = ["--app", f"{module}:app", "--app-dir", str(tmp_path)]
    assert main(["dlq", "list", *argv]) == 0
    listed = capsys.readouterr().out
    assert "dl-1" in listed and "not-mine" not in listed  # only the app's groups
    assert main(["dlq", "replay", "dl-2", *argv]) == 1  # another group's letter
    assert "no dead letter 'dl-2'" in capsys.readouterr().err
    assert main(["dlq", "replay", "dl-1", *argv]) == 0
    assert "replayed 1 dead letter" in capsys.readouterr().out
    sent = sys.modules[module].app.broker.sent
    assert len(sent) == 1
    topic, payload, key, headers = sent[0]
    assert (topic, key) == ("invoice.created", "inv-1")
    assert payload == make_letter(1).payload
    assert headers["eventflow-target-group"] == "billing"
    assert letter_ids(url) == ["dl-2"]


def test_missing_store_option(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EVENTFLOW_STORE", raising=False)
    assert main(["dlq", "list"]) == 2
    assert "no store given" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://x", "unsupported store URL"),
        ("memory://", "lives inside the app's process"),
        ("sqlite:///does/not/exist.db", "no SQLite database at"),
        ("sqlite://host/x.db", "has a host part"),
    ],
)
def test_bad_store_urls(url: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dlq", "list", "--store", url]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("eventflow: error:")
    assert "Traceback" not in err


def test_replay_with_nothing_to_replay_starts_no_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No letters: nothing to publish, so an unreachable broker is never waited for."""
    store_url = f"sqlite:///{tmp_path / 'empty.db'}"
    fill(store_url)
    began = time.monotonic()
    argv = ["dlq", "replay", "--all", "--store", store_url, "--broker", "nats://127.0.0.1:1"]
    assert main(argv) == 0
    assert time.monotonic() - began < 5
    assert "no dead letters to replay" in capsys.readouterr().out
