"""What a failed handler attempt leads to: the decision, apart from the code that acts on it.

- ``eventflow.Reject``, or an exception listed in ``@subscribe(..., give_up_on=...)``: the
  failure is permanent (a business rejection). Dead-lettered at once, reason ``rejected``,
  whatever attempts are left.
- ``eventflow.RetryLater(after=s)``: another attempt no sooner than ``s`` seconds later,
  kept by the broker (the message is given back with that delay, so the worker and the
  subscription's other keys go on); past the last attempt, dead-lettered as usual.
- Anything else: retried with the policy's backoff, then dead-lettered (``handler-failed``,
  or the error's own reason).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import EventflowError, Reject, RetryLater
from ..subscribe import HandlerSpec

__all__ = ["REJECTED", "Decision", "Verdict", "decide"]

REJECTED = "rejected"
"""The dead-letter reason of a permanent failure (``Reject``, ``give_up_on``)."""
_DEFAULT_REASON = "handler-failed"


class Verdict(enum.Enum):
    """What happens to the message after a failed attempt."""

    RETRY = "retry"
    """Another attempt after the retry policy's backoff."""
    LATER = "later"
    """Another attempt, given back to the broker with a delay (``RetryLater``)."""
    DEAD = "dead"
    """The dead-letter queue, now."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict, with the delay of ``LATER`` and the dead-letter reason of ``DEAD``."""

    verdict: Verdict
    delay: float = 0.0
    reason: str = _DEFAULT_REASON


def decide(error: BaseException, attempt: int, spec: HandlerSpec) -> Decision:
    """Decide what follows failed attempt number ``attempt`` (from 1) of ``spec``'s handler."""
    if isinstance(error, Reject):
        return Decision(Verdict.DEAD, reason=REJECTED)
    last = attempt >= spec.retry.max_attempts
    if isinstance(error, RetryLater):  # said explicitly: before a broad give_up_on=(Exception,)
        return Decision(Verdict.DEAD) if last else Decision(Verdict.LATER, delay=error.after)
    if spec.give_up_on and isinstance(error, spec.give_up_on):
        return Decision(Verdict.DEAD, reason=REJECTED)
    if last:
        # eventflow's errors name their reason (``publish-refused``, ...); a user's
        # exception is a handler failure, whatever attributes it has.
        reason = getattr(error, "reason", None) if isinstance(error, EventflowError) else None
        return Decision(Verdict.DEAD, reason=reason if isinstance(reason, str) else _DEFAULT_REASON)
    return Decision(Verdict.RETRY)
