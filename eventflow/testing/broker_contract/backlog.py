"""The broker contract's backlog tests: ``Broker.backlog`` counts what a group has not
settled (not yet delivered, or delivered and not acked), for that group only, and 0 once
everything is acked (allowing for acks that count a moment later: Kafka's commit interval,
NATS's acks sent without a reply)."""

from __future__ import annotations

from ...ports import Broker, declared
from .support import BrokerContractBase, BrokerFactory, collect, eventually, unique_name

__all__ = ["BacklogContract"]


class BacklogContract(BrokerContractBase):
    """``backlog(pattern, group=)``: what a group still has to handle on a pattern."""

    async def _backlog(self, broker: Broker, pattern: str, group: str) -> int | None:
        value: int | None = await declared(broker, Broker, "backlog")(pattern, group=group)
        assert value is None or isinstance(value, int), value
        return value

    async def _becomes(self, broker: Broker, pattern: str, group: str, want: int) -> None:
        seen: list[int | None] = []

        async def reached() -> bool:
            seen.append(await self._backlog(broker, pattern, group))
            return seen[-1] == want

        try:
            await eventually(reached, timeout=self.timeout, interval=0.1)
        except AssertionError:
            raise AssertionError(
                f"backlog of {group} on {pattern} never became {want}: last {seen[-5:]}"
            ) from None

    async def test_backlog_counts_what_a_group_has_not_acked(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Published and not delivered, then delivered and not acked: both count, seen from
        another process's broker; acked ones stop counting; another group is apart."""
        publisher, observer = await broker_factory(), await broker_factory()
        topic = f"{unique_name()}.backlog"
        group, other = unique_name("g"), unique_name("g")
        sub = await (await broker_factory()).subscribe(topic, group=group)
        done = await (await broker_factory()).subscribe(topic, group=other)
        assert await self._backlog(observer, topic, group) == 0
        n = 5
        for i in range(n):
            await publisher.publish(topic, f"m{i}".encode(), key=f"k{i}")
        await self._becomes(observer, topic, group, n)  # not delivered yet
        await collect(done, n, timeout=self.timeout)  # the other group handles all
        held = await collect(sub, n, timeout=self.timeout, ack=False)
        assert await self._backlog(observer, topic, group) == n  # delivered, not acked
        await self._becomes(observer, topic, other, 0)
        for d in held[:2]:
            await d.ack()
        await self._becomes(observer, topic, group, n - 2)
        for d in held[2:]:
            await d.ack()
        await self._becomes(observer, topic, group, 0)
        await self._becomes(publisher, topic, group, 0)  # any broker of the deployment

    async def test_backlog_of_a_wildcard_group_spans_its_topics(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A group on a wildcard pattern counts the messages of every topic it matches."""
        publisher, observer = await broker_factory(), await broker_factory()
        root, group = unique_name(), unique_name("g")
        topics = [f"{root}.a.placed", f"{root}.b.placed"]
        for topic in topics:  # the topics exist before the group joins (Kafka: no rebalance)
            await publisher.publish(topic, b"before", key="k")
        sub = await (await broker_factory()).subscribe(f"{root}.>", group=group)
        await self._becomes(observer, f"{root}.>", group, 0)  # earlier messages are not its
        for i, topic in enumerate(topics * 2):
            await publisher.publish(topic, f"m{i}".encode(), key=f"k{i}")
        await self._becomes(observer, f"{root}.>", group, 4)
        await collect(sub, 4, timeout=self.timeout)
        await self._becomes(observer, f"{root}.>", group, 0)
