"""When tracing is on, and that it costs nothing, not even an import, when it is off.

Each case runs in a child process of its own: what a process imported, and OpenTelemetry's
global tracer provider (settable once per process), are per process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

# A publish and its handling, through the outbox (a SQLite store) and directly.
_FLOW = """
import asyncio, sys
from eventflow import App, Context, Event, subscribe

class Pinged(Event, type="switch.pinged", version=1):
    n: int

class Ponged(Event, type="switch.ponged", version=1):
    n: int

seen = []

@subscribe("switch.pinged", group="a")
async def ping(event: Pinged, ctx: Context) -> None:
    async with ctx.transaction():
        await ctx.publish(Ponged(n=event.n))
    await ctx.publish(Ponged(n=-event.n))

@subscribe("switch.ponged", group="b")
async def pong(event: Ponged) -> None:
    seen.append(event.n)

async def flow(store: str, **options) -> None:
    del seen[:]
    async with App("switch", broker="memory://switch", store=store, handlers=[ping, pong],
                   **options) as app:
        await app.publish(Pinged(n=1))
        for _ in range(2000):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.005)
    assert sorted(seen) == [-1, 1], seen
"""


def _run(tmp_path: Path, body: str) -> str:
    """Run the flow's definitions then ``body`` in a new interpreter; its stdout."""
    script = tmp_path / "case.py"
    script.write_text(_FLOW + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("OTEL_PYTHON_TRACER_PROVIDER", None)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store.db")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_without_opentelemetry_imported_nothing_of_it_is_imported(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        asyncio.run(flow(f"sqlite:///{sys.argv[1]}"))
        print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
        """,
    )
    assert out == "[]"


def test_automatic_tracing_follows_the_global_provider_set_before_start(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        store = f"sqlite:///{sys.argv[1]}"
        asyncio.run(flow(store))  # imported, no provider set: off
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        print(len(exporter.get_finished_spans()))
        asyncio.run(flow(store, tracing=False))
        print(len(exporter.get_finished_spans()))
        asyncio.run(flow(store))  # set before this start: on
        print(sorted({s.name for s in exporter.get_finished_spans()}))
        """,
    )
    assert out.splitlines() == [
        "0",
        "0",
        "['process switch.pinged', 'process switch.ponged', 'relay switch.ponged', "
        "'send switch.pinged', 'send switch.ponged']",
    ]


def test_tracing_true_without_the_extra_names_it(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        sys.modules["opentelemetry"] = None  # as if opentelemetry-api were not installed
        asyncio.run(flow(f"sqlite:///{sys.argv[1]}"))  # automatic: off, no error
        try:
            App("switch", tracing=True)
        except ImportError as exc:
            print(exc)
        """,
    )
    assert "pip install 'eventflow[otel]'" in out


def test_the_tracing_docs_example_prints_what_they_say(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    doc = doc.split("\n## Tracing\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"^```python\n(.*?)^```", doc, re.M | re.S)[0]
    promised = re.findall(r"^```text\n(.*?)^```", doc, re.M | re.S)[0]
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == promised.splitlines()
