"""docs/fastapi.md runs as written: its example under uvicorn answers each ``curl`` of the
page with the status the page gives, and Ctrl-C (SIGTERM) drains the handler in flight;
its testing snippet runs against the same module. That a handler in flight is drained (not
cut) is shown for sure by ``test_asgi.py``, which holds one; here SIGTERM comes once the
handler printed its first line (then sleeps), and its last line must still come."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eventflow.testing.nats_server import nats_service_url
from eventflow.testing.services import free_port, stop_process

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "fastapi.md").read_text()
_START_TIMEOUT = 30.0


def _blocks(language: str) -> list[str]:
    return [
        textwrap.dedent(b) for b in re.findall(rf"^ *```{language}\n(.*?)^ *```", PAGE, re.M | re.S)
    ]


def _calls() -> list[tuple[str, str | None, int]]:
    """The page's ``curl`` calls: (url path and query, JSON body or None, promised status)."""
    calls = []
    for line in _blocks("bash")[0].splitlines():
        if not line.startswith("curl "):
            continue
        command, _, promise = line.partition("#")
        args = shlex.split(command)
        url = next(a for a in args[1:] if a.startswith("localhost:"))
        body = args[args.index("-d") + 1] if "-d" in args else None
        calls.append((url.removeprefix("localhost:8000"), body, int(promise.split()[0])))
    return calls


def _wait_ready(base: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"uvicorn did not answer /readyz within {_START_TIMEOUT}s")


@pytest.fixture(scope="module")
def docs_nats_url() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture(
    params=[
        pytest.param("memory", id="memory"),
        pytest.param("nats", id="nats-2-workers", marks=pytest.mark.service("nats")),
    ]
)
def where(request: pytest.FixtureRequest) -> tuple[dict[str, str], list[str]]:
    """The example's environment and uvicorn's extra arguments: memory://, one process;
    or NATS (a stream of its own) with two workers."""
    if request.param == "memory":
        return {}, []
    nats = request.getfixturevalue("docs_nats_url")
    broker = f"{nats}?stream=EFDOC{uuid.uuid4().hex[:10]}&storage=memory"
    return {"EVENTFLOW_BROKER": broker}, ["--workers", "2"]


def test_the_example_answers_what_the_page_says_and_drains_on_sigterm(
    tmp_path: Path, where: tuple[dict[str, str], list[str]]
) -> None:
    (tmp_path / "shop_http.py").write_text(_blocks("python")[0])
    command = _blocks("bash")[0].splitlines()[0]
    assert command == "uvicorn shop_http:http --port 8000"
    port = free_port()
    env, extra = where
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "shop_http:http", "--port", str(port), *extra],
        env={**os.environ, **env},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        calls = _calls()
        assert len(calls) == 5
        # The call that publishes goes last, so that SIGTERM can follow while its handler runs.
        calls.sort(key=lambda call: "?" not in call[0] and call[1] is not None)
        for path, body, promised in calls:
            answer = (
                httpx.post(
                    f"{base}{path}", content=body, headers={"content-type": "application/json"}
                )
                if body is not None
                else httpx.get(f"{base}{path}")
            )
            assert answer.status_code == promised, (path, answer.text)
        # SIGTERM once `confirm` runs on o-1 (it then sleeps): it is drained, not cut. (A
        # message not fetched yet when the signal comes stays in the broker, unhandled.)
        assert proc.stdout is not None
        seen = []
        while "confirming o-1" not in seen:
            line = proc.stdout.readline()
            assert line, "uvicorn ended before the handler ran"
            seen.append(line.rstrip("\n"))
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=30)
        out = "\n".join([*seen, rest])
    finally:
        stop_process(proc)  # type: ignore[arg-type]
    # uvicorn 0.29+ re-raises the signal once its shutdown completed (so its own parent
    # sees how it ended): -SIGTERM here is a clean exit, as the log line below says.
    assert proc.returncode in (0, -signal.SIGTERM), err
    printed = [line for line in out.splitlines() if not line.startswith("INFO:")]  # access log
    assert printed == ["confirming o-1", "confirmed o-1"], (out, err)
    assert "Application shutdown complete" in err


def test_the_testing_snippet_runs(tmp_path: Path) -> None:
    (tmp_path / "shop_http.py").write_text(_blocks("python")[0])
    snippet = _blocks("python")[1]
    script = "\n".join(
        [
            "import asyncio",
            "import httpx",
            "from eventflow.asgi import lifespan",
            "from shop_http import events, http",
            "async def main() -> None:",
            textwrap.indent(snippet, "    "),
            "    print('ok')",
            "asyncio.run(main())",
        ]
    )
    (tmp_path / "check.py").write_text(script)
    proc = subprocess.run(
        [sys.executable, "check.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "ok"
