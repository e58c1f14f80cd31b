"""What every test service resolver shares: is this CI, does Docker answer, and what to do
when no service can be had (skip, or fail under ``CI=true``)."""

from __future__ import annotations

import os
import socket
import subprocess
from typing import NoReturn

__all__ = ["docker_answers", "free_port", "in_ci", "service_unavailable", "stop_process"]


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


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Stop a server process gracefully: SIGTERM, then SIGKILL after 10 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
