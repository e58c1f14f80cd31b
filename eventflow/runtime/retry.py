"""Retry policy: a bounded number of attempts with exponential backoff and full jitter."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..errors import ConfigurationError

__all__ = ["DEFAULT_MAX_ATTEMPTS", "RetryPolicy"]

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_INITIAL_DELAY = 0.1
DEFAULT_MAX_DELAY = 30.0
DEFAULT_MULTIPLIER = 2.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently a failing handler is retried.

    ``max_attempts`` counts every attempt, the first included (``retry=5``: at most 5 calls).
    Before attempt ``n+1`` the consumer sleeps a random time in
    ``[0, min(max_delay, initial_delay * multiplier**(n-1))]`` ("full jitter"), so the first
    delay is at most ``initial_delay`` (0.1 s by default).
    """

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    initial_delay: float = DEFAULT_INITIAL_DELAY
    max_delay: float = DEFAULT_MAX_DELAY
    multiplier: float = DEFAULT_MULTIPLIER

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ConfigurationError(
                f"max_attempts must be an int (attempts in all), got {self.max_attempts!r}"
            )
        if self.max_attempts < 1:
            raise ConfigurationError(
                f"max_attempts counts every attempt, the first included, so it must be >= 1 "
                f"(got {self.max_attempts}): use max_attempts=1 for a single attempt"
            )
        if self.initial_delay < 0 or self.max_delay < 0 or self.multiplier < 1:
            raise ConfigurationError(
                "retry delays must be >= 0 and the multiplier >= 1 "
                f"(got initial_delay={self.initial_delay}, max_delay={self.max_delay}, "
                f"multiplier={self.multiplier})"
            )

    def backoff_cap(self, attempt: int) -> float:
        """Upper bound of the sleep after failed attempt number ``attempt`` (1-based)."""
        return float(min(self.max_delay, self.initial_delay * self.multiplier ** (attempt - 1)))

    def delay(self, attempt: int) -> float:
        """A random sleep (full jitter) after failed attempt number ``attempt``."""
        return random.random() * self.backoff_cap(attempt)

    @classmethod
    def of(cls, value: int | RetryPolicy | None) -> RetryPolicy:
        """Normalise ``retry=``: an int is ``max_attempts``, None means a single attempt.

        ``retry`` counts attempts in all, so ``retry=0`` (or less) would mean "never call the
        handler": it is refused rather than quietly turned into one attempt."""
        if isinstance(value, RetryPolicy):
            return value
        if value is None:
            return cls(max_attempts=1)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(
                f"retry must be an int (max attempts) or a RetryPolicy, got {value!r}"
            )
        if value < 1:
            raise ConfigurationError(
                f"retry={value} is not a number of attempts: retry counts every attempt, the "
                "first included; write retry=1 (or retry=None) for a single attempt with no "
                "retries, retry=3 for up to three"
            )
        return cls(max_attempts=value)
