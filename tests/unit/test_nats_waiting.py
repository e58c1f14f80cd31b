"""What a NATS member waiting for partitions tells (``eventflow/adapters/nats/waiting.py``):
once per dead holder, which partitions and in about how many seconds they move, and when to
claim again; nothing about a live holder handing its partitions over."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import pytest

from eventflow.adapters.nats import NatsBrokerConfig
from eventflow.adapters.nats.ledger import Holder
from eventflow.adapters.nats.waiting import Waiting, ranges

CONFIG = NatsBrokerConfig()  # ack_wait 4 s, lease_ttl 6.83 s
TTL = CONFIG.effective_lease_ttl


class FakeLeases:
    """Lease holders by key, as the lease bucket would tell them."""

    def __init__(self) -> None:
        self.holders: dict[str, Holder] = {}
        self.reads = 0

    async def holder(self, key: str) -> Holder | None:
        self.reads += 1
        return self.holders.get(key)


def _waiting(leases: FakeLeases, alive: set[str]) -> Waiting:
    leases_any: Any = leases
    return Waiting("billing", "pay.*", CONFIG, leases_any, alive.__contains__)


def test_ranges() -> None:
    assert ranges([5, 0, 1, 2, 3]) == "0-3, 5"
    assert ranges([6, 4, 2, 0]) == "0, 2, 4, 6"


async def test_a_dead_holder_is_told_once_with_when_its_partitions_move(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="eventflow.nats")
    leases = FakeLeases()
    stopped = time.time() - 3.0  # its last refresh, 3 s ago
    for p in (1, 3, 5, 7):
        leases.holders[f"g.{p}"] = Holder("dead01", stopped)
    waiting = _waiting(leases, alive={"me"})
    keys = {p: f"g.{p}" for p in (1, 3, 5, 7)}
    await waiting.note(keys, now=100.0)
    await waiting.note(keys, now=100.5)  # claims failed again: nothing new to tell
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1, told
    assert "partitions 1, 3, 5, 7" in told[0] and "dead01" in told[0]
    assert "in about 3.8s" in told[0], told[0]  # 6.8 s of TTL less 3 s already gone
    assert leases.reads == 4, "each lease is read once until it should have expired"
    assert waiting.retry_at == pytest.approx(100.0 + TTL - 3.0 + 0.3, abs=0.1)
    waiting.claimed([1, 3, 5, 7])
    assert "took over partitions 1, 3, 5, 7 from member dead01" in caplog.records[-1].getMessage()
    assert waiting.retry_at == math.inf


async def test_a_live_holder_handing_over_is_not_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="eventflow.nats")
    leases = FakeLeases()
    # Refreshed just now (draining its messages), or heartbeating although its lease looks
    # old (a clock ahead of the server's): both alive.
    leases.holders["g.0"] = Holder("busy01", time.time())
    leases.holders["g.2"] = Holder("known1", time.time() - 5.0)
    waiting = _waiting(leases, alive={"me", "known1"})
    await waiting.note({0: "g.0", 2: "g.2"}, now=10.0)
    assert not caplog.records
    assert waiting.retry_at == math.inf, "a live holder's release wakes the claim instead"
