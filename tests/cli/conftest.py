"""Fixtures for the command-line tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import fill, make_letter


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    """A SQLite store with three dead letters (two groups) and no heartbeats."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    fill(url, [make_letter(1), make_letter(2), make_letter(3, group="shipping")])
    return url
