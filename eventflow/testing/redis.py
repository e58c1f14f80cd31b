"""A Redis server for tests: ``EVENTFLOW_TEST_REDIS_URL``, else the local default if it
answers, else skip (fail under ``CI=true``)."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from .services import service_unavailable

__all__ = ["DEFAULT_URL", "ENV_VAR", "redis_url"]

ENV_VAR = "EVENTFLOW_TEST_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/15"


def redis_url() -> str:
    """The Redis URL tests use (database 15 by default); skips or fails when none answers."""
    url = os.environ.get(ENV_VAR, DEFAULT_URL)
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), 2):
            return url
    except OSError as exc:
        service_unavailable(
            f"no Redis at {url} ({exc}); start one or set {ENV_VAR}", named=ENV_VAR in os.environ
        )
