"""The errors of limits and circuit breakers (part of :mod:`eventflow.errors`' tree).

``GivenBack`` is what the consumer looks for: an exception of it leaving a handler gives the
message back to the broker untouched, without spending an attempt, instead of counting as
a failed attempt.
"""

from __future__ import annotations

from ..errors import EventflowError

__all__ = ["CircuitOpenError", "GivenBack", "LimitTimeoutError"]


class GivenBack(EventflowError):
    """A handler could not begin its work for a reason outside the message (a dependency's
    breaker is open, no slot came free in time): the message goes back to the broker
    untouched, without spending an attempt, and is handled later."""

    limit: str
    """The name of the limit that gave the message back."""


class CircuitOpenError(GivenBack):
    """``async with ctx.limit(name)`` found the limit's circuit breaker open (or half-open,
    with its one probe already running), or a failure it counts just opened it.

    Let it leave the handler: the message is given back without spending an attempt, and the
    subscription pauses fetching until the breaker lets a probe through (``retry_at``)."""

    def __init__(self, limit: str, retry_at: float, detail: str = "") -> None:
        self.limit = limit
        self.retry_at = retry_at
        """Wall time (Unix seconds) at which the breaker lets a probe through, or a guess at
        when to look again (half-open: when the running probe should be over)."""
        text = (
            f"the circuit breaker of limit {limit!r} is open{': ' + detail if detail else ''}; "
            "the message is given back without spending an attempt and handled once the "
            "dependency recovers (see `eventflow status`)"
        )
        super().__init__(text)


class LimitTimeoutError(GivenBack):
    """``async with ctx.limit(name)`` waited ``timeout`` seconds without getting a slot (or
    a rate token): the message is given back without spending an attempt. Raise the limit's
    ``timeout`` (or lower the handlers' ``concurrency``) if this happens often."""

    def __init__(self, limit: str, waited: float, what: str) -> None:
        self.limit = limit
        self.waited = waited
        super().__init__(
            f"no {what} of limit {limit!r} came free within {waited:g}s; the message is given "
            "back without spending an attempt (raise Limit(timeout=...) or size the limit "
            "with concurrency = rate x latency)"
        )
