"""The command line drawn for people (issue 22, item 6): on a terminal, tables, trees and
progress bars come from rich; into a pipe the output is the plain text scripts parse, and
rich is not even imported."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import fill, make_beat

from eventflow.cli import main
from eventflow.cli._draw import RichProgress, terminal

ROOT = Path(__file__).resolve().parents[2]


def _on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("eventflow.cli._draw.terminal", lambda stream=None: True)
    monkeypatch.setattr("eventflow.cli.trace.terminal", lambda stream=None: True)
    monkeypatch.setattr("eventflow.cli.store.terminal", lambda stream=None: True)


def test_status_on_a_terminal_is_a_rich_table_with_health_in_colour(
    store_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(store_url, beats=[make_beat("billing", health="degraded", problems=("broker: down",))])
    _on_a_terminal(monkeypatch)
    assert main(["status", "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert "─" in out  # rich's rule under the header
    assert "\x1b[1;33mDEGRADED" in out  # bold yellow
    assert "billing@host:42:abc: broker: down" in out


def test_dlq_list_on_a_terminal_and_into_a_pipe(
    store_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["dlq", "list", "--store", store_url]) == 0
    plain = capsys.readouterr().out
    assert plain.splitlines()[0].split() == [
        "ID", "GROUP", "TOPIC", "REASON", "ATTEMPTS", "FAILED", "AT", "ERROR",
    ]  # fmt: skip
    assert "\x1b[" not in plain and "─" not in plain
    _on_a_terminal(monkeypatch)
    assert main(["dlq", "list", "--store", store_url]) == 0
    drawn = capsys.readouterr().out
    assert "─" in drawn and "dl-1" in drawn and "dl-3" in drawn


def test_trace_on_a_terminal_is_a_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_cli_trace import _fill

    url = f"sqlite:///{tmp_path / 'trace.db'}"
    correlation = _fill(url)
    _on_a_terminal(monkeypatch)
    assert main(["trace", correlation, "--store", url]) == 0
    out = capsys.readouterr().out
    assert "└── " in out and "cli.trace.ordered v1" in out
    assert "DEAD LETTER of group billing" in out


def test_the_rich_progress_bar_reaches_the_end() -> None:
    stream = io.StringIO()
    bar = RichProgress(stream, "stock")
    for position in range(0, 1001, 250):
        bar(position, 1000)
    bar.finish()
    assert "1000/1000" in stream.getvalue() and "stock" in stream.getvalue()


def test_a_pipe_gets_plain_text_without_importing_rich(store_url: str) -> None:
    code = (
        "import sys; from eventflow.cli import main; "
        f"code = main(['status', '--store', {store_url!r}]); "
        "print('RICH' if 'rich' in sys.modules else 'NO-RICH'); sys.exit(code)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("NO-RICH")
    assert "dead letters: 3" in done.stdout


def test_plain_is_forced_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert terminal(Tty())
    monkeypatch.setenv("EVENTFLOW_PLAIN", "1")
    assert not terminal(Tty())


def test_store_read_on_a_terminal_is_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_cli_trace import _fill

    url = f"sqlite:///{tmp_path / 'read.db'}"
    _fill(url)
    assert main(["store", "read", "--all", "--store", url]) == 0
    plain = capsys.readouterr().out.splitlines()
    assert len(plain) == 3 and plain[0].split()[0] == "1"  # one line per event, as before
    _on_a_terminal(monkeypatch)
    assert main(["store", "read", "--all", "--store", url]) == 0
    drawn = capsys.readouterr().out
    assert "POSITION" in drawn and "─" in drawn and "order-1@1" in drawn


def test_a_narrow_terminal_folds_only_the_last_column(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 100-column terminal, ``store read`` and ``dlq list`` folded every column,
    ids included (``...7ecc85d61b`` on one line, ``76`` under it): an id a person cannot
    copy. The ids, names and times keep their width and the free text of the last column
    folds; where that does not fit either, lines run past the terminal, nothing cropped."""
    import re

    from eventflow.cli._draw import terminal_table

    monkeypatch.setenv("COLUMNS", "100")
    ident = "01a234b9-2729-7146-878e-7ecc85d61b76"
    drawn = terminal_table(
        ["POSITION", "STREAM", "ID", "DATA"],
        [["2", "saga-obsorder-o-1@2", ident, '{"kind": "command-sent", ' * 8]],
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", drawn)
    assert ident in text and "saga-obsorder-o-1@2" in text
    assert max(len(line) for line in text.splitlines()) <= 100  # it fits: the data folds
    assert len(text.splitlines()) > 3
    wide = terminal_table(
        ["ID", "GROUP", "TOPIC", "FAILED AT", "ERROR"],
        [[ident, "inventory", "obs.order.placed", "2026-12-02 03:07:59Z", "ValueError: x"]],
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", wide)
    assert ident in text and "2026-12-02 03:07:59Z" in text and "ValueError: x" in text
