"""``eventflow.Lag``: a broker's answer to how far a group is behind, and its age."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from eventflow import Lag

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def test_age_is_the_seconds_since_the_oldest_message() -> None:
    assert Lag(3, NOW - timedelta(seconds=2.5)).age(NOW) == 2.5


def test_nothing_pending_has_no_age() -> None:
    assert Lag(0, None).age(NOW) == 0.0


def test_a_broker_clock_ahead_of_ours_gives_no_negative_age() -> None:
    assert Lag(1, NOW + timedelta(seconds=0.3)).age(NOW) == 0.0


def test_lag_is_a_frozen_value() -> None:
    lag = Lag(1, NOW)
    assert lag == Lag(1, NOW) and hash(lag) == hash(Lag(1, NOW))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lag.messages = 2  # type: ignore[misc]
