"""Failure classes (``runtime.outcomes.decide``), their exceptions, the new ``@subscribe``
options and ``ctx.idempotency_key``'s derivation."""

from __future__ import annotations

import pytest

from eventflow import (
    ConfigurationError,
    Envelope,
    HandlerTimeoutError,
    MessageRefusedError,
    Reject,
    RetryLater,
    subscribe,
)
from eventflow.context import idempotency_key
from eventflow.runtime.outcomes import REJECTED, Decision, Verdict, decide
from eventflow.subscribe import HandlerSpec, collect_handlers


def _spec(**options: object) -> HandlerSpec:
    @subscribe("unit.outcome", **options)  # type: ignore[arg-type]
    async def handle(env: Envelope) -> None:
        return None

    [spec] = collect_handlers([handle])
    return spec


def test_reject_is_dead_lettered_at_once_whatever_attempts_are_left() -> None:
    spec = _spec(retry=5)
    assert decide(Reject("out of stock"), 1, spec) == Decision(Verdict.DEAD, reason=REJECTED)


def test_give_up_on_types_and_their_subclasses_are_rejections() -> None:
    class Declined(ValueError):
        pass

    spec = _spec(retry=5, give_up_on=(ValueError,))
    assert decide(ValueError("not enough sku-b"), 1, spec).reason == "rejected"
    assert decide(Declined("card"), 2, spec).verdict is Verdict.DEAD
    assert decide(KeyError("other"), 1, spec) == Decision(Verdict.RETRY)  # positive control


def test_other_failures_retry_then_die_as_handler_failures() -> None:
    spec = _spec(retry=3)
    assert decide(RuntimeError("x"), 2, spec) == Decision(Verdict.RETRY)
    assert decide(RuntimeError("x"), 3, spec) == Decision(Verdict.DEAD, reason="handler-failed")
    assert decide(HandlerTimeoutError("slow"), 3, spec).reason == "handler-failed"
    # eventflow's own errors keep their reason; a user exception's `reason` attribute does not
    # become the letter's reason.
    assert decide(MessageRefusedError("big"), 3, spec).reason == "publish-refused"

    class HTTPError(Exception):
        reason = "Not Found"

    assert decide(HTTPError(), 3, spec).reason == "handler-failed"


def test_retry_later_is_kept_by_the_broker_within_the_attempts() -> None:
    spec = _spec(retry=3)
    assert decide(RetryLater(after=2), 1, spec) == Decision(Verdict.LATER, delay=2.0)
    assert decide(RetryLater(after=2), 3, spec) == Decision(Verdict.DEAD, reason="handler-failed")


def test_retry_later_wins_over_a_broad_give_up_on() -> None:
    spec = _spec(retry=3, give_up_on=(Exception,))
    assert decide(RetryLater(after=1), 1, spec) == Decision(Verdict.LATER, delay=1.0)
    assert decide(RuntimeError("x"), 1, spec).reason == "rejected"  # the rest is given up


def test_reject_and_retry_later_refuse_bad_arguments() -> None:
    assert str(Reject("why")) == "why"
    assert Reject("why").reason == "rejected"  # the dead letter's reason, as DecodeError's
    with pytest.raises(TypeError, match="text that says why"):
        Reject("")
    for bad in (-1, float("inf"), float("nan"), "2", True):
        with pytest.raises(TypeError, match="seconds >= 0"):
            RetryLater(after=bad)  # type: ignore[arg-type]
    assert str(RetryLater(after=1.5, reason="429")) == "429: retry no sooner than 1.5s from now"


def test_subscribe_checks_give_up_on_and_hard_timeout() -> None:
    assert _spec(give_up_on=ValueError).give_up_on == (ValueError,)
    assert _spec(give_up_on=[ValueError, KeyError]).give_up_on == (ValueError, KeyError)
    for bad in ("ValueError", (ValueError, "x"), (BaseException,), 3):
        with pytest.raises(ConfigurationError, match="give_up_on takes exception classes"):
            subscribe("unit.outcome", give_up_on=bad)  # type: ignore[arg-type]
    assert _spec(timeout=1.0, hard_timeout=3).hard_timeout == 3.0
    assert _spec().hard_timeout is None
    with pytest.raises(ConfigurationError, match="needs a soft timeout below it"):
        subscribe("unit.outcome", timeout=10, hard_timeout=5)
    with pytest.raises(ConfigurationError, match="needs a soft timeout below it"):
        subscribe("unit.outcome", timeout=None, hard_timeout=5)
    for bad in (0, -1, float("inf"), "30", True):
        with pytest.raises(ConfigurationError, match="hard_timeout must be"):
            subscribe("unit.outcome", hard_timeout=bad)  # type: ignore[arg-type]


def test_idempotency_key_is_a_fixed_function_of_group_and_envelope_id() -> None:
    """Pinned: a change of the derivation would change every key in flight, and a provider
    would take the retries of a deploy's in-flight messages for new requests."""
    env_id = "0190a9b8-7c3d-7e21-9f00-123456789abc"
    assert idempotency_key("billing", env_id) == idempotency_key("billing", env_id)
    assert idempotency_key("billing", env_id) == "3624fe9e-7dd8-5af0-beb1-f2917579d803"
    assert idempotency_key("audit", env_id) != idempotency_key("billing", env_id)
    assert idempotency_key("billing", env_id[:-1] + "d") != idempotency_key("billing", env_id)
    # The separator keeps ("ab", "c") and ("a", "bc") apart.
    assert idempotency_key("ab", "c") != idempotency_key("a", "bc")
