"""`eventflow run MODULE:APP --port PORT`: the app serves /healthz, /readyz and /metrics
on that port until SIGTERM; --port with several apps is refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from eventflow.cli import main

SERVICE = """
from eventflow import App, Envelope, subscribe

@subscribe("cli.port.ping")
async def pong(env: Envelope) -> None: ...

app = App("cli-port", handlers=[pong])
other = App("cli-port-other")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2.0)
    except httpx.TransportError:
        return None


def test_run_port_serves_health_and_metrics_until_sigterm(tmp_path: Path) -> None:
    (tmp_path / "port_service.py").write_text(textwrap.dedent(SERVICE))
    port = _free_port()
    command = ["run", "port_service:app", "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "eventflow.cli", *command],
        cwd=tmp_path,
        env={**os.environ},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        ready = None
        while time.monotonic() < deadline:
            ready = _get(f"http://127.0.0.1:{port}/readyz")
            if ready is not None and ready.status_code == 200:
                break
            time.sleep(0.1)
        assert ready is not None and ready.status_code == 200, ready
        assert ready.json() == {"app": "cli-port", "status": "ok", "problems": []}
        health = _get(f"http://127.0.0.1:{port}/healthz")
        assert health is not None and health.text == "ok\n"
        metrics = _get(f"http://127.0.0.1:{port}/metrics")
        assert metrics is not None and metrics.status_code == 200
        assert 'eventflow_consumer_lag_messages{group="cli-port",topic="cli.port.ping"}' in (
            metrics.text
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err


def test_port_with_several_apps_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "port_service2.py").write_text(textwrap.dedent(SERVICE))
    apps = ["port_service2:app", "port_service2:other"]
    code = main(["run", *apps, "--port", "0", "--app-dir", str(tmp_path)])
    assert code == 2
    assert "--port serves one app" in capsys.readouterr().err
