"""The broker contract's group tests: fan-out to every group, competing consumers, per-key
order and durable groups."""

from __future__ import annotations

from collections import Counter, defaultdict

from ...ports import Delivery
from .support import (
    BrokerContractBase,
    BrokerFactory,
    Member,
    _run_members,
    _texts,
    collect,
    drain,
    unique_name,
)

__all__ = ["GroupContract"]


class GroupContract(BrokerContractBase):
    """Groups: every group gets every message, members of one group share them in key order."""

    # -- groups ------------------------------------------------------------------------------

    async def test_every_group_receives_every_message(self, broker_factory: BrokerFactory) -> None:
        """Each group (exact or wildcard pattern, any broker) gets all matching messages."""
        publisher = await broker_factory()
        root = unique_name()
        topic = f"{root}.stock.reserved"
        subs = [
            await (await broker_factory()).subscribe(topic, group=unique_name("g")),
            await (await broker_factory()).subscribe(topic, group=unique_name("g")),
            await (await broker_factory()).subscribe(f"{root}.>", group=unique_name("g")),
        ]
        payloads = [f"m{i}" for i in range(10)]
        for p in payloads:
            await publisher.publish(topic, p.encode(), key="k")
        for sub in subs:
            assert _texts(await collect(sub, len(payloads), timeout=self.timeout)) == payloads
        for sub in subs:
            assert await drain(sub, self.quiet_period) == []

    async def test_competing_consumers_share_a_group(self, broker_factory: BrokerFactory) -> None:
        """Within a group each message reaches exactly one live member, and both get some."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.work", unique_name("g")
        members = [
            Member(f"m{i}", await (await broker_factory()).subscribe(topic, group=group))
            for i in range(2)
        ]
        n = 64
        for i in range(n):
            await publisher.publish(topic, f"job-{i}".encode(), key=f"key-{i}")
        await _run_members(
            members,
            lambda: sum(len(m.received) for m in members) >= n,
            timeout=self.timeout,
            quiet=self.quiet_period,
        )
        counts = Counter(p for m in members for p in _texts(m.received))
        assert counts == Counter(f"job-{i}" for i in range(n)), "each message exactly once"
        assert all(m.received for m in members), [len(m.received) for m in members]

    async def test_per_key_order_with_two_members(self, broker_factory: BrokerFactory) -> None:
        """Two members of one group see each key's messages in publish order."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.ordered", unique_name("g")
        log: list[tuple[str, Delivery]] = []
        members = [
            Member(f"m{i}", await (await broker_factory()).subscribe(topic, group=group), log)
            for i in range(2)
        ]
        keys, per_key = [f"k{i}" for i in range(16)], 10
        for seq in range(per_key):
            for key in keys:
                await publisher.publish(topic, f"{key}:{seq}".encode(), key=key)
        total = len(keys) * per_key
        await _run_members(
            members, lambda: len(log) >= total, timeout=self.timeout, quiet=self.quiet_period
        )
        seen: dict[str, list[int]] = defaultdict(list)
        for _, d in log:
            key, number = d.payload.decode().split(":")
            assert d.key == key
            seen[key].append(int(number))
        assert seen == {key: list(range(per_key)) for key in keys}
        assert all(m.received for m in members), [len(m.received) for m in members]

    async def test_group_keeps_messages_while_it_has_no_members(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A group whose members all left still receives; the next member gets the messages."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.durable", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        assert _texts(await collect(first, 1, timeout=self.timeout)) == ["m0"]
        await first.close()
        for i in range(1, 4):
            await publisher.publish(topic, f"m{i}".encode(), key="k")
        second = await (await broker_factory()).subscribe(topic, group=group)
        got = await collect(second, 3, timeout=self.timeout)
        assert _texts(got) == ["m1", "m2", "m3"]
        assert await drain(second, self.quiet_period) == []
