"""What every test service resolver shares: is this CI, does Docker answer, and what to do
when no service can be had (skip, or fail under ``CI=true``)."""

from __future__ import annotations

import os
from typing import NoReturn

__all__ = ["docker_answers", "in_ci", "service_unavailable"]


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
