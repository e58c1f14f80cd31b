"""Helpers for the schema tests: a throwaway module of Event classes and the CLI in-process."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from eventflow.cli import main
from eventflow.events import default_registry


@dataclass
class Result:
    """What one CLI run returned and printed."""

    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        """stdout and stderr together."""
        return self.out + self.err

    def json(self) -> Any:
        """stdout parsed as JSON."""
        return json.loads(self.out)


def run_cli(*argv: str) -> Result:
    """Run ``eventflow ARGV`` in this process and capture its output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return Result(code, out.getvalue(), err.getvalue())


class Project:
    """A directory holding one module of Event classes and a ``schemas/`` registry.

    The module gets a unique name and its event types a unique prefix (``T``), so tests
    never collide in the process-wide registry. ``write`` replaces the module's source, as a
    developer editing the file would; the next command imports it afresh.
    """

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.module = f"evmod_{uuid.uuid4().hex[:10]}"
        self.type = f"{self.module}.thing"
        self.registry = root / "schemas"
        monkeypatch.setattr(sys, "dont_write_bytecode", True)
        monkeypatch.setattr(sys, "path", list(sys.path))

    def write(self, source: str) -> None:
        """Replace the module's source (``{T}`` stands for the type name)."""
        (self.root / f"{self.module}.py").write_text(source.replace("{T}", self.type))
        sys.modules.pop(self.module, None)
        importlib.invalidate_caches()

    def new_module(self) -> None:
        """Move the events to a new module (same type names), as a fresh process would see.

        The process-wide registry keeps classes of a module's earlier source; a new module
        name leaves them behind, so removed classes are really gone for ``--module``.
        """
        (self.root / f"{self.module}.py").unlink()
        sys.modules.pop(self.module, None)
        self.module = f"evmod_{uuid.uuid4().hex[:10]}"
        # What a new process would not have: this project's classes and upcasters.
        prefix = self.type.split(".")[0]
        for name in [t for t in default_registry._classes if t.startswith(prefix)]:
            del default_registry._classes[name]
        for key in [k for k in default_registry._upcasters if k[0].startswith(prefix)]:
            del default_registry._upcasters[key]

    def cli(self, action: str, *extra: str) -> Result:
        """``eventflow schema ACTION --module <module>`` on this project."""
        return run_cli(
            "schema",
            action,
            "--module",
            self.module,
            "--app-dir",
            str(self.root),
            "--dir",
            str(self.registry),
            *extra,
        )

    def rules(self, result: Result) -> set[str]:
        """The rules of the errors in a ``--json`` check result."""
        return {p["rule"] for p in result.json()["problems"] if p["severity"] == "error"}


HEADER = """
from typing import Literal

from pydantic import ConfigDict, Field

from eventflow import Event, upcaster
"""


def v1(mode: str = "backward", extra: str = "") -> str:
    """Version 1 of the test event: a string, an int, an enum and an optional note."""
    return (
        HEADER
        + f"""

class ThingV1(Event, type="{{T}}", version=1, compatibility="{mode}"):
    name: str
    qty: int
    color: Literal["red", "green", "blue"]
    note: str | None = None
{extra}
"""
    )


def v2(body: str, mode: str = "backward", upcast: str | None = None) -> str:
    """Version 1 plus a version 2 with ``body`` as fields, and an optional upcaster body."""
    source = (
        v1(mode)
        + f"""

class ThingV2(Event, type="{{T}}", version=2, compatibility="{mode}"):
{body}
"""
    )
    if upcast is not None:
        source += f"""

@upcaster("{{T}}", from_version=1)
def _to_v2(data: dict) -> dict:
    {upcast}
"""
    return source
