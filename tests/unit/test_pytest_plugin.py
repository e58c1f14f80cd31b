"""The pytest plugin users get (``eventflow.testing.plugin``): the user's test file of
docs/testing.md, run by pytester, passes with its fixtures (memory, NATS, PostgreSQL); a
failing ``eventually`` reports the last value; importing the plugin imports no driver and
defines no autouse fixture."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]


def _example() -> str:
    """The user's test file docs/testing.md shows (its one Python block)."""
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 1, "docs/testing.md should show one Python block, a test file"
    return str(blocks[0])


FAILING = """
import pytest

from eventflow.testing import eventually


class Pending:
    def __init__(self, left: int) -> None:
        self.left = left

    def __bool__(self) -> bool:
        return self.left == 0

    def __repr__(self) -> str:
        return f"Pending(left={self.left})"


@pytest.mark.asyncio
async def test_never() -> None:
    await eventually(lambda: Pending(3), timeout=0.2, message="the orders")
"""


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "eventflow.testing.plugin" for ep in entry_points(group="pytest11"))


def test_a_user_test_file_passes_and_a_failing_eventually_reports_the_last_value(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_greeter=_example())
    pytester.makepyfile(test_failing=textwrap.dedent(FAILING))
    # A subprocess, as a user's run is: the plugin loads through its entry point (or, where
    # the installed metadata predates it, -p), in pytest-asyncio's default strict mode.
    args = [] if _entry_point_installed() else ["-p", "eventflow.testing.plugin"]
    result = pytester.runpytest_subprocess(
        *args, "-p", "no:cacheprovider", "-o", "asyncio_mode=strict"
    )
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        ["*the orders did not hold within 0.2s; last value: Pending(left=3)*"]
    )


def test_the_entry_point_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["entry-points"]["pytest11"] == {
        "eventflow": "eventflow.testing.plugin"
    }


def test_importing_the_plugin_imports_no_driver_and_adds_no_autouse_fixture() -> None:
    code = textwrap.dedent(
        """
        import sys
        import eventflow.testing.plugin as plugin
        drivers = {"nats", "aiokafka", "asyncpg", "redis", "opentelemetry", "prometheus_client"}
        print(sorted(m for m in sys.modules if m.split(".")[0] in drivers))
        marks = {n: v._fixture_function_marker for n, v in vars(plugin).items()
                 if hasattr(v, "_fixture_function_marker")}
        print(sorted(marks))
        print(sorted(n for n, m in marks.items() if m.autouse))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split("\n")
    assert out[:3] == ["[]", "['kafka_url', 'make_app', 'nats_url', 'postgres_url']", "[]"]
