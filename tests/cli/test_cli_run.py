"""`eventflow run MODULE:APP`: clear errors for bad targets, a real run stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
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
    err = capsys.readouterr().err
    assert "raised RuntimeError at " in err and "broken_service_mod.py:1: boom at import" in err
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
    # The shop's services each keep their own store: shop.db -> shop-shipping.db, ...
    urls = {name: f"sqlite:///{tmp_path / f'shop-{name}.db'}" for name in ("shipping", "inventory")}
    proc = _start(
        ["examples.shop.shipping:app", "examples.shop.inventory:app", "--app-dir", str(REPO)],
        cwd=tmp_path,
        env={"SHOP_STORE": f"sqlite:///{tmp_path / 'shop.db'}"},
    )
    try:
        _wait_for(
            lambda: all(
                os.path.exists(tmp_path / f"shop-{name}.db") and _instances(url) == [f"shop-{name}"]
                for name, url in urls.items()
            )
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopped shop-shipping, shop-inventory" in err
    assert all(_instances(url) == [] for url in urls.values())


@contextlib.contextmanager
def _silent_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A TCP port that accepts connections and never answers (a wrong port, a firewall
    that swallows packets): a client's first connection hangs until its own timeout. Yields
    the port and the list of connections it has accepted."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1]), held
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@pytest.mark.parametrize(
    ("sig", "where"),
    [
        (signal.SIGTERM, "store"),
        (signal.SIGINT, "store"),
        (signal.SIGTERM, "broker"),
        (signal.SIGINT, "broker"),
    ],
)
def test_a_signal_ends_a_start_up_that_hangs(
    tmp_path: Path, sig: signal.Signals, where: str
) -> None:
    with _silent_server() as (port, accepted):
        # A store or a broker that never answers, with a connect timeout far longer than
        # the test: only the signal can end the start-up.
        target = (
            f'store="postgresql://postgres@127.0.0.1:{port}/test?connect_timeout=120"'
            if where == "store"
            else f'broker="nats://127.0.0.1:{port}?connect_timeout=120"'
        )
        (tmp_path / "hanging_service.py").write_text(
            textwrap.dedent(
                f"""
                from eventflow import App

                app = App("hanging", {target})
                """
            )
        )
        proc = _start(["hanging_service:app"], cwd=tmp_path)
        try:
            # Wait until start-up is connecting (the server has its connection), however
            # long the import takes on a busy machine: only then is the signal a test.
            deadline = time.monotonic() + 30
            while not accepted and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert accepted and proc.poll() is None, proc.communicate()
            began = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=10)
            took = time.monotonic() - began
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    assert took < 5, f"start-up took {took:.1f}s to end after {sig.name}"
    assert "start-up interrupted" in err


def test_a_component_that_cannot_recover_exits_non_zero_naming_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'svc.db'}"
    (tmp_path / "failing_service.py").write_text(
        textwrap.dedent(
            f"""
            from eventflow import App, Envelope, subscribe
            from eventflow.adapters.memory import MemoryBroker


            class BuggyBroker(MemoryBroker):
                # A broker adapter with a bug: its subscriptions fail on the first fetch.
                async def subscribe(self, pattern, *, group, start="latest"):
                    sub = await super().subscribe(pattern, group=group, start=start)

                    async def fetch(max_messages, timeout):
                        raise RuntimeError("bug in the adapter")

                    sub.fetch = fetch
                    return sub


            @subscribe("ping", group="pinger")
            async def pong(env: Envelope) -> None: ...

            app = App("failing-svc", broker=BuggyBroker(), store={url!r}, handlers=[pong])
            """
        )
    )
    proc = _start(["failing_service:app"], cwd=tmp_path)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "consumer pinger:ping failed and cannot recover" in err
    assert "RuntimeError: bug in the adapter" in err
    # Its last heartbeat says so.
    status = subprocess.run(
        [sys.executable, "-m", "eventflow.cli", "status", "--store", url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    [instance] = json.loads(status.stdout)["instances"]
    assert instance["health"] == "failed"
    assert any("consumer pinger:ping" in p for p in instance["problems"])
    text = subprocess.run(
        [sys.executable, "-m", "eventflow.cli", "status", "--store", url],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "FAILED" in text and "1 unhealthy" in text
