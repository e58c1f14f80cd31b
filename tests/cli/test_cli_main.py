"""The ``eventflow`` entry point itself: what every command shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import fill, make_letter

from eventflow.cli import EXIT_BROKEN_PIPE, main


class _GoneReader:
    """A stdout whose reader went away (``| head`` exited)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise ValueError("not a real file")


def test_a_reader_that_goes_away_ends_the_command_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    fill(url, [make_letter(n) for n in range(1, 4)])
    assert main(["dlq", "list", "--store", url]) == 0  # positive control: it prints
    assert "dl-1" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdout", _GoneReader())
    assert main(["dlq", "list", "--store", url]) == EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""  # no traceback, no error line


def test_a_real_pipe_closed_early_gives_no_traceback(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    fill(url, [make_letter(n % 60, id=f"dl-{n}", envelope_id=f"e-{n}") for n in range(2000)])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eventflow.cli",
            "dlq",
            "list",
            "--json",
            "--limit",
            "5000",
            "--store",
            url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does after its line
    err = proc.stderr.read().decode()
    proc.stderr.close()
    proc.wait(timeout=60)
    assert first  # it printed before the reader left
    assert "Traceback" not in err, err
    assert proc.returncode in (0, EXIT_BROKEN_PIPE)
