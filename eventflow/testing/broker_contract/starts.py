"""The broker contract's tests of new groups: where a group that does not exist yet begins
(``subscribe(..., start="latest" | "earliest")``), ``Broker.declare`` creating a group
without consuming, the log line of a group's first start, and an existing group keeping
its position whatever ``start`` says."""

from __future__ import annotations

import logging

import pytest

from ...errors import ConfigurationError
from ...ports import Broker, StartPosition, declared
from .support import BrokerContractBase, BrokerFactory, _texts, collect, drain, unique_name

__all__ = ["StartContract"]

_GROUPS_LOGGER = "eventflow.groups"


class StartContract(BrokerContractBase):
    """New groups begin at ``start``; declared and existing groups keep their position."""

    async def _declare(
        self,
        broker: Broker,
        pattern: str,
        group: str,
        *,
        start: StartPosition = "latest",
        create: bool = True,
    ) -> bool:
        declare = declared(broker, Broker, "declare")
        existed = await declare(pattern, group=group, start=start, create=create)
        assert isinstance(existed, bool), existed
        return existed

    @staticmethod
    def _new_group_lines(caplog: pytest.LogCaptureFixture, group: str) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == _GROUPS_LOGGER and f"group {group} is new" in r.getMessage()
        ]

    async def test_a_new_group_with_start_earliest_gets_what_was_published_before(
        self, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A command published before its group ever subscribed reaches the group's first
        member when it subscribes with ``start="earliest"``, in order, then new ones too;
        the first start logs that it begins at the oldest message kept."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.command", unique_name("g")
        await publisher.publish(topic, b"before-0", key="k")
        await publisher.publish(topic, b"before-1", key="k")
        with caplog.at_level(logging.INFO, logger=_GROUPS_LOGGER):
            sub = await (await broker_factory()).subscribe(topic, group=group, start="earliest")
        await publisher.publish(topic, b"after", key="k")
        got = await collect(sub, 3, timeout=self.timeout)
        assert _texts(got) == ["before-0", "before-1", "after"]
        assert await drain(sub, self.quiet_period) == []
        [line] = self._new_group_lines(caplog, group)
        assert "oldest message" in line and "start='earliest'" in line and topic in line

    async def test_a_new_group_with_start_latest_begins_after_what_was_published(
        self, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        """``start="latest"`` (the default): what was published before the group existed is
        not delivered to it, what is published after its subscribe is (the positive
        control), and the first start says so in the log."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.command", unique_name("g")
        await publisher.publish(topic, b"before", key="k")
        with caplog.at_level(logging.INFO, logger=_GROUPS_LOGGER):
            sub = await (await broker_factory()).subscribe(topic, group=group, start="latest")
        await publisher.publish(topic, b"after", key="k")
        assert _texts(await collect(sub, 1, timeout=self.timeout)) == ["after"]
        assert await drain(sub, self.quiet_period) == []
        [line] = self._new_group_lines(caplog, group)
        assert "end of" in line and "start='latest'" in line and "not delivered" in line

    async def test_a_declared_group_gets_what_was_published_after_the_declare(
        self, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        """``declare`` creates the group without consuming (``create=False`` only looks):
        messages published after it wait for the group's first member, which subscribes
        with the default start; the group's creation is logged once, by the declare."""
        admin, publisher = await broker_factory(), await broker_factory()
        topic, group = f"{unique_name()}.command", unique_name("g")
        with caplog.at_level(logging.INFO, logger=_GROUPS_LOGGER):
            assert await self._declare(admin, topic, group, create=False) is False
            assert await self._declare(admin, topic, group) is False, "it did not exist"
            assert await self._declare(admin, topic, group, create=False) is True
            assert await self._declare(admin, topic, group) is True, "it exists now"
            for i in range(3):
                await publisher.publish(topic, f"m{i}".encode(), key="k")
            sub = await (await broker_factory()).subscribe(topic, group=group)
        got = await collect(sub, 3, timeout=self.timeout)
        assert _texts(got) == ["m0", "m1", "m2"]
        assert await drain(sub, self.quiet_period) == []
        assert len(self._new_group_lines(caplog, group)) == 1

    async def test_declare_with_start_earliest_keeps_what_was_published_before(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A group declared with ``start="earliest"`` begins at the oldest message kept."""
        admin, publisher = await broker_factory(), await broker_factory()
        topic, group = f"{unique_name()}.command", unique_name("g")
        await publisher.publish(topic, b"before", key="k")
        assert await self._declare(admin, topic, group, start="earliest") is False
        await publisher.publish(topic, b"after", key="k")
        sub = await (await broker_factory()).subscribe(topic, group=group)
        assert _texts(await collect(sub, 2, timeout=self.timeout)) == ["before", "after"]
        assert await drain(sub, self.quiet_period) == []

    async def test_an_existing_group_keeps_its_position_whatever_start_says(
        self, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        """``start`` applies only to a group that does not exist yet: a member subscribing
        with ``start="earliest"`` (or a declare with it) to a group that handled messages
        before does not get them again; it gets what came while the group had no member."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.command", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        assert _texts(await collect(first, 1, timeout=self.timeout)) == ["m0"]
        await first.close()
        await publisher.publish(topic, b"m1", key="k")
        assert await self._declare(await broker_factory(), topic, group, start="earliest")
        with caplog.at_level(logging.INFO, logger=_GROUPS_LOGGER):
            second = await (await broker_factory()).subscribe(topic, group=group, start="earliest")
        assert _texts(await collect(second, 1, timeout=self.timeout)) == ["m1"]
        assert await drain(second, self.quiet_period) == []
        assert self._new_group_lines(caplog, group) == []

    async def test_a_group_without_members_gets_a_new_topic_of_its_pattern(
        self, broker_factory: BrokerFactory
    ) -> None:
        """An existing group on a wildcard gets the messages of a topic first published
        while it had no member: the group existed before them."""
        publisher = await broker_factory()
        root, group = unique_name(), unique_name("g")
        await publisher.publish(f"{root}.a", b"a0", key="k")
        first = await (await broker_factory()).subscribe(f"{root}.>", group=group)
        await publisher.publish(f"{root}.a", b"a1", key="k")
        assert _texts(await collect(first, 1, timeout=self.timeout)) == ["a1"]
        await first.close()
        await publisher.publish(f"{root}.b", b"b0", key="k")  # a topic new to the broker
        second = await (await broker_factory()).subscribe(f"{root}.>", group=group)
        assert _texts(await collect(second, 1, timeout=self.timeout)) == ["b0"]
        assert await drain(second, self.quiet_period) == []

    async def test_a_group_with_a_live_member_can_be_declared_on_another_pattern(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A new handler of a running app: its group has a live member on another pattern
        (on Kafka, one consumer group); declaring it on the new pattern works, the new
        pattern's messages wait for it, and the live member goes on receiving its own."""
        publisher = await broker_factory()
        root, group = unique_name(), unique_name("g")
        await publisher.publish(f"{root}.new", b"before", key="k")
        live = await (await broker_factory()).subscribe(f"{root}.old", group=group)
        assert await self._declare(await broker_factory(), f"{root}.new", group) is False
        await publisher.publish(f"{root}.new", b"n0", key="k")
        await publisher.publish(f"{root}.old", b"o0", key="k")
        assert _texts(await collect(live, 1, timeout=self.timeout)) == ["o0"]
        joined = await (await broker_factory()).subscribe(f"{root}.new", group=group)
        assert _texts(await collect(joined, 1, timeout=self.timeout)) == ["n0"]
        assert await drain(joined, self.quiet_period) == []

    async def test_a_start_that_is_not_latest_or_earliest_is_refused(
        self, broker_factory: BrokerFactory
    ) -> None:
        """``start`` other than ``"latest"`` or ``"earliest"``: a ``ConfigurationError``
        naming both, from ``subscribe`` and ``declare``, and nothing is created."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.command", unique_name("g")
        with pytest.raises(ConfigurationError, match="'latest' or 'earliest'"):
            await broker.subscribe(topic, group=group, start="oldest")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="'latest' or 'earliest'"):
            await self._declare(broker, topic, group, start="first")  # type: ignore[arg-type]
        assert await self._declare(broker, topic, group, create=False) is False
