"""Limits and circuit breakers on calls to other services (DESIGN section 9).

``Limit`` / ``Breaker`` (``spec``) are declared with ``App(limits=[...])`` and taken in
handlers with ``async with ctx.limit(name):`` (``limiter.Taken``). ``registry.Limits`` holds
an app's limiters; ``local`` keeps process-scope slots, rate and breaker in memory;
``shared`` keeps cluster ones on a ``LimitBackend`` (``sql``: the app's store; Redis:
``eventflow.adapters.redis.limits``); ``breaker`` holds the breaker's rules; ``pause`` is
how a consumer gives back what a limit refused and stops fetching while a breaker is open.
"""

from .errors import CircuitOpenError, GivenBack, LimitTimeoutError
from .registry import Limits
from .spec import Breaker, Limit

__all__ = ("Breaker", "CircuitOpenError", "GivenBack", "Limit", "LimitTimeoutError", "Limits")
