"""`eventflow run MODULE:APP`: clear errors for bad targets, a real run stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eventflow import open_store
from eventflow.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected MODULE:APP"),
        (":app", "expected MODULE:APP"),
        ("module:", "expected MODULE:APP"),
        ("a:b:c", "expected MODULE:APP"),
        ("surely_no_such_module_xyz:app", "cannot import module 'surely_no_such_module_xyz'"),
        ("json:app", "module 'json' has no attribute 'app'"),
        ("json:loads", "is a function, not an eventflow App"),
    ],
)
def test_bad_module_app_exits_2_with_a_clear_message(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eventflow: error:") and message in err
    assert "Traceback" not in err


def test_import_errors_inside_the_module_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken_service_mod.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "two_apps_mod.py").write_text(
        "from eventflow import App\nfirst = App('first')\nsecond = App('second')\n"
    )
    assert main(["run", "broken_service_mod:app", "--app-dir", str(tmp_path)]) == 2
    assert "raised RuntimeError: boom at import" in capsys.readouterr().err
    assert main(["run", "two_apps_mod:app", "--app-dir", str(tmp_path)]) == 2
    assert "App objects in it: first, second" in capsys.readouterr().err


def test_bad_target_from_the_console_script_is_not_a_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eventflow.cli", "run", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "expected MODULE:APP" in proc.stderr and "Traceback" not in proc.stderr


def _instances(url: str) -> list[str]:
    async def go() -> list[str]:
        async with open_store(url) as store:
            return sorted(b.app for b in await store.heartbeats.list())

    return asyncio.run(go())


def _wait_for(predicate: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def _start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "eventflow.cli", "run", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_run_serves_until_sigterm(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'svc.db'}"
    (tmp_path / "ping_service.py").write_text(
        textwrap.dedent(
            f"""
            from eventflow import App, Envelope, subscribe

            @subscribe("ping")
            async def pong(env: Envelope) -> None: ...

            app = App("ping-svc", store={url!r}, handlers=[pong], heartbeat_interval=0.2)
            """
        )
    )
    proc = _start(["ping_service:app", "--log-level", "debug"], cwd=tmp_path)
    try:
        _wait_for(lambda: os.path.exists(tmp_path / "svc.db") and _instances(url) == ["ping-svc"])
        assert proc.poll() is None  # still serving
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "app ping-svc running (1 subscriptions)" in err  # logging goes to stderr
    assert _instances(url) == []  # a clean shutdown removes the heartbeat


def test_run_several_apps_in_one_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    proc = _start(
        ["examples.shop.orders:app", "examples.shop.inventory:app", "--app-dir", str(REPO)],
        cwd=tmp_path,
        env={"SHOP_STORE": url},
    )
    try:
        _wait_for(
            lambda: (
                os.path.exists(tmp_path / "shop.db") and _instances(url) == ["inventory", "orders"]
            )
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopped orders, inventory" in err
    assert _instances(url) == []
