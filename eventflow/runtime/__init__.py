"""The consumer runtime: dispatch, retry, dead letters, timeouts, shutdown, heartbeat."""

from .retry import RetryPolicy

__all__ = ("RetryPolicy",)
