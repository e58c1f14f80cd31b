"""``eventflow groups declare|list MODULE:APP`` against a real NATS server: a participant's
group declared before its first start gets the command published before that start; a
group nobody declared begins at the end (it misses it, then gets the next one)."""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import ModuleType

import pytest

from eventflow import App
from eventflow.cli import main
from eventflow.testing.broker_contract import eventually

pytestmark = pytest.mark.service("nats")

_PARTICIPANTS = """
from eventflow import App, Event, subscribe


class ReserveStock(Event, type={topic!r}):
    n: int


reserved: list[int] = []
audited: list[int] = []


@subscribe({topic!r}, group={group!r})
async def reserve(event: ReserveStock) -> None:
    reserved.append(event.n)


@subscribe({topic!r}, group={other!r})
async def audit(event: ReserveStock) -> None:
    audited.append(event.n)


inventory = App("inventory", broker={broker!r}, handlers=[reserve])
auditor = App("auditor", broker={broker!r}, handlers=[audit])
"""


def _write(tmp_path: Path, module: str, **names: str) -> None:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(_PARTICIPANTS.format(**names)))


def _import(tmp_path: Path, module: str) -> ModuleType:
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    return importlib.import_module(module)


def _eventflow(*argv: str) -> tuple[int, str]:
    """Run the command in a process of its own, as a deploy script would: its exit code
    and stdout (stderr goes with a failure's message)."""
    proc = subprocess.run(
        [sys.executable, "-m", "eventflow.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stdout + proc.stderr


def test_a_declared_participant_handles_the_command_sent_before_its_first_start(
    nats_url: str, tmp_path: Path
) -> None:
    """The saga app sends a command before the participant ever ran: with its group
    declared first, the participant's first start handles it; another group on the same
    topic, not declared, begins at the end (it misses that one and gets the next)."""
    uid = uuid.uuid4().hex[:10]
    url = f"{nats_url}?stream=EF_CLI_GROUPS&storage=memory"
    topic, group, other = f"cligroups{uid}.reserve", f"inventory-{uid}", f"audit-{uid}"
    module = f"participants_{uid}"
    _write(tmp_path, module, topic=topic, group=group, other=other, broker=url)
    where = ("--app-dir", str(tmp_path))

    code, out = _eventflow("groups", "list", f"{module}:inventory", *where)
    assert code == 0 and f"{group}  {topic}  latest  missing" in out, out

    code, out = _eventflow("groups", "declare", f"{module}:inventory", *where)
    assert code == 0 and f"{group}  {topic}  latest  created" in out, out
    assert "created 1, already existed 0" in out

    code, out = _eventflow("groups", "declare", f"{module}:inventory", *where, "--json")
    assert code == 0
    assert json.loads(out) == {
        "app": "inventory",
        "group": group,
        "pattern": topic,
        "start": "latest",
        "existed": True,
        "created": False,
    }
    apps = (f"{module}:inventory", f"{module}:auditor")
    code, out = _eventflow("groups", "list", *apps, *where, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [(r["group"], r["existed"]) for r in rows] == [
        (group, True),
        (other, False),
    ]
    mod = _import(tmp_path, module)

    async def saga_app_then_participants() -> None:
        async with App("saga-app", broker=url) as sender:
            await sender.publish(mod.ReserveStock(n=1), key="o-1")
        async with mod.inventory, mod.auditor:
            await eventually(lambda: mod.reserved == [1], message="the declared group got 1")
            async with App("saga-app", broker=url) as sender:
                await sender.publish(mod.ReserveStock(n=2), key="o-1")
            await eventually(lambda: mod.audited == [2], message="the other group got 2")
            await eventually(lambda: mod.reserved == [1, 2], message="the declared got 2")
        assert mod.audited == [2], "a group nobody declared begins at the end"

    asyncio.run(saga_app_then_participants())


def test_groups_on_the_memory_broker_are_refused_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The memory broker lives in the app's process: nothing to declare from outside."""
    uid = uuid.uuid4().hex[:10]
    module = f"memory_{uid}"
    _write(tmp_path, module, topic=f"clim{uid}.x", group="g", other="h", broker="memory://")
    for action in ("declare", "list"):
        assert main(["groups", action, f"{module}:inventory", "--app-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("eventflow: error: the memory:// broker lives inside")
        assert "start the participants before" in err and "Traceback" not in err
