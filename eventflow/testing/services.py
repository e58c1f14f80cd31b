"""What every test service resolver shares: is this CI, does Docker answer, and what to do
when no service can be had (skip, or fail under ``CI=true``)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = [
    "PORT_TRIES",
    "docker_answers",
    "free_port",
    "holds_listener",
    "in_ci",
    "log_says_port_in_use",
    "service_unavailable",
    "start_on_own_ports",
    "stop_process",
]


def in_ci() -> bool:
    """True when running under CI (``CI=true``): missing services fail instead of skipping."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def docker_answers() -> bool:
    """True if a Docker engine answers (so testcontainers can start a service)."""
    try:
        import docker  # type: ignore[import-not-found, import-untyped, unused-ignore]

        docker.from_env().ping()
        return True
    except Exception:
        return False


def service_unavailable(message: str, *, named: bool = False) -> NoReturn:
    """Skip the calling test with ``message`` or, under CI (or when the service was named
    explicitly by an environment variable), fail it."""
    import pytest

    if in_ci() or named:
        pytest.fail(f"{message} (a missing service fails the run here, it is not skipped)")
    pytest.skip(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def holds_listener(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the TCP socket listening on ``port`` (Linux, read from
    ``/proc``); None where that cannot be told (no ``/proc``, or nothing listens there yet).

    A server started on a :func:`free_port` may find the port taken meanwhile: by another
    process's connection (the server then fails to bind and exits) or by another test
    server, which then answers the readiness check in its place. Only the second needs this
    check, and :func:`free_port`'s race cannot be closed without it: the port is free when it
    is chosen, and the server binds it later.
    """
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    held = set()
    for fd in fds:
        try:
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile
    return inodes <= held


PORT_TRIES = 5
"""Ports a test server tries, each a fresh :func:`free_port`, before it gives up."""


def log_says_port_in_use(log: Path, offset: int) -> bool:
    """Whether a server's ``log``, from byte ``offset`` (where this start began writing),
    says it could not bind its port (nats-server: "address already in use"; Tansu: "Address
    in use")."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return b"address in use" in f.read().lower().replace(b"already ", b"")
    except OSError:
        return False


def start_on_own_ports(
    first: bool,
    log: Path,
    launch: Callable[[], None],
    ready: Callable[[int], bool],
    stop: Callable[[], None],
    new_ports: Callable[[], None],
) -> bool:
    """Start a test server: ``launch`` it and wait until ``ready(offset)`` (``offset``: where
    this start began writing to ``log``) says it runs on ports of its own. If it says the
    ports are another process's, ``stop`` it and, on a ``first`` start only, try again on
    ``new_ports``, up to ``PORT_TRIES`` in all: a restarted server keeps its ports, which its
    clients reconnect to. False if every try found a port taken."""
    tries = PORT_TRIES if first else 1
    for attempt in range(tries):
        offset = log.stat().st_size if log.exists() else 0
        launch()
        if ready(offset):
            return True
        stop()
        if attempt + 1 < tries:
            new_ports()
    return False


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Stop a server process gracefully: SIGTERM, then SIGKILL after 10 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
