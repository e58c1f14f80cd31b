"""``Limit`` and ``Breaker``: what an app declares (``App(limits=[...])``), checked here.

Every mistake is refused when the limit is built, with what to write instead, rather than at
the first message a handler takes it for.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigurationError
from ..urls import redact_url, url_scheme

__all__ = [
    "DEFAULT_LIMIT_TIMEOUT",
    "DEFAULT_SLOT_TTL",
    "Breaker",
    "Limit",
    "Scope",
    "check_limits",
]

Scope = Literal["process", "cluster"]
DEFAULT_SLOT_TTL = 10.0
"""Seconds a cluster slot outlives its holder's last renewal (a dead holder's slot is free
again after this)."""
DEFAULT_LIMIT_TIMEOUT = 10.0
"""Seconds ``ctx.limit`` waits for a slot or a token before it gives the message back."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")


def _seconds(owner: str, what: str, value: object, *, zero: bool = False) -> float:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and (value >= 0 if zero else value > 0)
        and math.isfinite(value)
    )
    if not ok:
        floor = ">= 0" if zero else "above 0"
        raise ConfigurationError(
            f"{owner}: {what} takes a number of seconds {floor}, got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def _count(owner: str, what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{owner}: {what} takes a whole number >= 1, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Breaker:
    """A circuit breaker, part of a :class:`Limit`.

    It counts exceptions of the ``on`` types that leave ``async with ctx.limit(name)``;
    ``failures`` of them within ``window`` seconds open it. While open, entering the limit
    raises ``CircuitOpenError`` (the message is given back without spending an attempt and
    the subscription pauses fetching); ``reset`` seconds after it opened, one call is let
    through as a probe (half-open): its success closes the breaker, a counted failure opens
    it again for another ``reset``. Exceptions of other types pass through uncounted.
    """

    failures: int = 5
    window: float = 30.0
    reset: float = 15.0
    on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        owner = "Breaker"
        _count(owner, "failures", self.failures)
        object.__setattr__(self, "window", _seconds(owner, "window", self.window))
        object.__setattr__(self, "reset", _seconds(owner, "reset", self.reset))
        on: object = self.on
        if isinstance(on, type):
            on = (on,)
        if isinstance(on, str) or not isinstance(on, Iterable):
            raise ConfigurationError(
                f"Breaker(on=...) takes exception classes, e.g. on=(httpx.HTTPError,), got {on!r}"
            )
        found = tuple(on)
        if not found or not all(isinstance(c, type) and issubclass(c, Exception) for c in found):
            raise ConfigurationError(
                "Breaker(on=...) takes one or more exception classes (subclasses of "
                f"Exception), e.g. on=(httpx.HTTPError, TimeoutError), got {self.on!r}"
            )
        object.__setattr__(self, "on", found)


@dataclass(frozen=True, slots=True)
class Limit:
    """A named limit on calls to a dependency, taken in handlers with
    ``async with ctx.limit(name):``.

    - ``concurrency``: at most this many blocks inside the limit at once.
    - ``rate``: at most ``rate`` blocks entered per second (a token bucket of ``burst``
      tokens, 1 by default: the entries are spaced ``1/rate`` apart, so no interval of
      ``T`` seconds sees more than ``burst + rate * T``).
    - ``breaker``: a :class:`Breaker` for the dependency.
    - ``scope``: ``"process"`` (the default) counts in this process only; ``"cluster"``
      shares the limit (and its breaker) with every instance, through the app's store (a
      PostgreSQL store, or a SQLite file for processes on one machine) or through Redis
      with ``backend="redis://host:6379/0"``. A cluster slot is a lease of ``ttl`` seconds,
      renewed while held, so the slots of a holder that died are free again after ``ttl``.
    - ``timeout``: seconds entering waits for a slot or a token; past it the message is
      given back without spending an attempt (``LimitTimeoutError``).
    """

    name: str
    concurrency: int | None = None
    rate: float | None = None
    burst: int = 1
    breaker: Breaker | None = None
    scope: Scope = "process"
    backend: str | None = None
    ttl: float = DEFAULT_SLOT_TTL
    timeout: float = DEFAULT_LIMIT_TIMEOUT

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigurationError(
                f"a limit's name is 1-100 letters, digits, '.', '_', ':' or '-' (say the "
                f"dependency: Limit('payments-api', ...)), got {self.name!r}"
            )
        owner = f"Limit({self.name!r})"
        if self.concurrency is not None:
            _count(owner, "concurrency", self.concurrency)
        if self.rate is not None:
            object.__setattr__(self, "rate", _seconds(owner, "rate (calls per second)", self.rate))
        _count(owner, "burst", self.burst)
        if self.breaker is not None and not isinstance(self.breaker, Breaker):
            raise ConfigurationError(
                f"{owner}: breaker takes a Breaker(failures=..., window=..., reset=..., "
                f"on=(...)), got {self.breaker!r}"
            )
        if self.concurrency is None and self.rate is None and self.breaker is None:
            raise ConfigurationError(
                f"{owner} limits nothing: give it concurrency=..., rate=... and/or breaker=..."
            )
        if self.scope not in ("process", "cluster"):
            raise ConfigurationError(
                f"{owner}: scope is 'process' (this process only) or 'cluster' (every "
                f"instance), got {self.scope!r}"
            )
        if self.backend is not None:
            if self.scope != "cluster":
                raise ConfigurationError(
                    f"{owner}: backend= shares a limit across instances; add scope='cluster' "
                    "(a process-scope limit needs no backend)"
                )
            if not isinstance(self.backend, str) or url_scheme(self.backend) not in (
                "redis",
                "rediss",
            ):
                shown = redact_url(self.backend) if isinstance(self.backend, str) else self.backend
                raise ConfigurationError(
                    f"{owner}: backend takes a Redis URL (redis://host:6379/0), got {shown!r}; "
                    "leave it unset to share the limit through the app's SQL store"
                )
        object.__setattr__(self, "ttl", _seconds(owner, "ttl", self.ttl))
        object.__setattr__(self, "timeout", _seconds(owner, "timeout", self.timeout, zero=True))

    @property
    def emission(self) -> float:
        """Seconds between two entries at the full rate (0.0 without a rate)."""
        return 1.0 / self.rate if self.rate else 0.0


def check_limits(limits: Iterable[object]) -> dict[str, Limit]:
    """``App(limits=...)`` as a dict by name; refuses what is not a ``Limit`` and two
    limits of one name."""
    if isinstance(limits, (Limit, str)) or not isinstance(limits, Iterable):
        raise ConfigurationError(
            f"limits= takes a list of Limit(...), e.g. limits=[Limit('api', concurrency=5)], "
            f"got {limits!r}"
        )
    found: dict[str, Limit] = {}
    for limit in limits:
        if not isinstance(limit, Limit):
            raise ConfigurationError(
                f"limits= takes Limit(...) instances, e.g. Limit('api', concurrency=5), "
                f"got {limit!r}"
            )
        if limit.name in found:
            raise ConfigurationError(
                f"two limits are named {limit.name!r}: a name is one dependency, declare it once"
            )
        found[limit.name] = limit
    return found
