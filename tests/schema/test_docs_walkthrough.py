"""docs/schemas.md's walkthrough, run as written: its files and its commands.

```python title="FILE"``` blocks are written to FILE in an empty directory (a later block
with the same title replaces it); ```console``` blocks hold ``$ eventflow ...`` commands
(``# exit code N`` when not 0) followed by what they print, which must appear in order.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from schema_support import run_cli

from eventflow.events import default_registry

DOC = Path(__file__).parents[2] / "docs" / "schemas.md"
BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.M | re.S)
TYPES_PREFIX = "billing."


def steps() -> list[tuple[str, str, str]]:
    """(kind, title, body) for each file or console block, in order."""
    out = []
    for lang, info, body in BLOCK.findall(DOC.read_text()):
        title = re.search(r'title="([^"]+)"', info)
        if lang == "python" and title:
            out.append(("file", title.group(1), body))
        elif lang == "console":
            out.append(("console", "", body))
    return out


def _fresh_process(module: str) -> None:
    """Forget the walkthrough's module and event types, as a new `eventflow` process would."""
    sys.modules.pop(module, None)
    for name in [t for t in default_registry._classes if t.startswith(TYPES_PREFIX)]:
        del default_registry._classes[name]
    for key in [k for k in default_registry._upcasters if k[0].startswith(TYPES_PREFIX)]:
        del default_registry._upcasters[key]


def test_walkthrough_runs_as_documented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "path", list(sys.path))
    found = steps()
    assert sum(kind == "console" for kind, _, _ in found) >= 5
    commands = 0
    module = ""
    for kind, title, body in found:
        if kind == "file":
            (tmp_path / title).write_text(body)
            module = title.removesuffix(".py")
            continue
        lines = body.splitlines()
        i = 0
        while i < len(lines):
            command = lines[i]
            assert command.startswith("$ eventflow "), command
            expected_code = 0
            if "# exit code" in command:
                command, _, code = command.partition("# exit code")
                expected_code = int(code)
            i += 1
            expected = []
            while i < len(lines) and not lines[i].startswith("$ "):
                expected.append(lines[i])
                i += 1
            _fresh_process(module)
            result = run_cli(*shlex.split(command)[2:])
            commands += 1
            assert result.code == expected_code, f"{command}\n{result.text}"
            actual = result.text.splitlines()
            position = 0
            for line in expected:
                assert line in actual[position:], f"{command}: missing {line!r} in\n{result.text}"
                position = actual.index(line, position) + 1
    assert commands >= 7
    _fresh_process(module)
