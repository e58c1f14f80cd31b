"""RetryPolicy: attempts, exponential backoff with full jitter, the cap."""

import dataclasses

import pytest

from eventflow import ConfigurationError, RetryPolicy, subscribe
from eventflow.subscribe import collect_handlers


def test_defaults_make_the_first_delay_well_under_a_second() -> None:
    policy = RetryPolicy()
    assert policy.max_attempts >= 2
    assert policy.backoff_cap(1) < 1.0
    assert all(0.0 <= policy.delay(1) < 1.0 for _ in range(1000))


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    policy = RetryPolicy(max_attempts=10, initial_delay=0.1, multiplier=2.0, max_delay=1.0)
    caps = [policy.backoff_cap(n) for n in range(1, 8)]
    assert caps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert policy.backoff_cap(1000) == 1.0  # no overflow past the cap


@pytest.mark.parametrize("attempt", [1, 2, 3, 6])
def test_full_jitter_spreads_over_zero_to_the_cap(attempt: int) -> None:
    policy = RetryPolicy(initial_delay=0.2, multiplier=3.0, max_delay=2.0)
    cap = policy.backoff_cap(attempt)
    samples = [policy.delay(attempt) for _ in range(4000)]
    assert all(0.0 <= s <= cap for s in samples)
    # Full jitter: uniform over [0, cap], not "cap plus a little noise". With 4000 samples the
    # chance of either bucket being empty is below 1e-200.
    assert any(s < cap * 0.1 for s in samples)
    assert any(s > cap * 0.9 for s in samples)
    assert sum(samples) / len(samples) == pytest.approx(cap / 2, rel=0.1)


def test_zero_delays_are_allowed() -> None:
    policy = RetryPolicy(max_attempts=2, initial_delay=0.0)
    assert policy.delay(1) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"initial_delay": -0.1},
        {"max_delay": -1.0},
        {"multiplier": 0.5},
    ],
)
def test_invalid_policies_raise(kwargs: dict) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**kwargs)


def test_policy_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RetryPolicy().max_attempts = 9  # type: ignore[misc]


def test_of_normalises_the_retry_argument() -> None:
    assert RetryPolicy.of(5).max_attempts == 5
    assert RetryPolicy.of(1).max_attempts == 1
    assert RetryPolicy.of(None).max_attempts == 1
    custom = RetryPolicy(max_attempts=7, initial_delay=0.01)
    assert RetryPolicy.of(custom) is custom
    assert RetryPolicy.of(5).initial_delay == RetryPolicy().initial_delay


@pytest.mark.parametrize("value", [0, -1, -100])
def test_of_refuses_fewer_than_one_attempt(value: int) -> None:
    # retry counts attempts in all: 0 would mean "never call the handler", not "no retries".
    with pytest.raises(ConfigurationError, match=rf"retry={value}.*retry=1"):
        RetryPolicy.of(value)


def test_max_attempts_message_says_it_counts_the_first_attempt() -> None:
    with pytest.raises(ConfigurationError, match=r"the first included.*max_attempts=1"):
        RetryPolicy(max_attempts=0)


@pytest.mark.parametrize("value", [2.5, "3", True])
def test_policy_refuses_a_max_attempts_that_is_not_an_int(value: object) -> None:
    with pytest.raises(ConfigurationError, match="max_attempts must be an int"):
        RetryPolicy(max_attempts=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, "3", 2.5, [3]])
def test_of_rejects_other_types(value: object) -> None:
    with pytest.raises(ConfigurationError, match="retry"):
        RetryPolicy.of(value)  # type: ignore[arg-type]


def test_subscribe_retry_means_attempts_in_all() -> None:
    @subscribe("ut.retry.a", retry=5)
    async def five(event: object) -> None: ...

    @subscribe("ut.retry.b", retry=None)
    async def once(event: object) -> None: ...

    policy = RetryPolicy(max_attempts=4, initial_delay=0.01)

    @subscribe("ut.retry.c", retry=policy)
    async def custom(event: object) -> None: ...

    specs = collect_handlers([five, once, custom])
    assert [s.retry.max_attempts for s in specs] == [5, 1, 4]
    assert specs[2].retry is policy
