"""The memory broker's hubs: the groups of every broker opened on one ``memory://NAME``,
the routes from topics to groups and the newest messages kept for new groups."""

from __future__ import annotations

from collections import deque

from ...patterns import matches
from .config import MemoryBrokerConfig
from .groups import Group, Record

__all__ = ["Hub", "hubs"]

_MAX_ROUTES = 4096  # topics whose target groups a hub remembers (then it starts over)


class Hub:
    """The groups of every broker opened on one ``memory://NAME``, the topic routes and the
    newest messages published (``retain``)."""

    def __init__(self, config: MemoryBrokerConfig) -> None:
        self.config = config
        self.groups: dict[tuple[str, str], Group] = {}
        # The newest messages published on the hub (``retain``, at most ``retain_bytes``
        # of payload): where a group created with start="earliest" begins.
        self.retained: deque[Record] = deque()
        self.retained_bytes = 0
        self.routes: dict[str, list[Group]] = {}
        self.refs = 0

    def retain(self, record: Record) -> None:
        """Keep ``record`` among the newest messages, dropping the oldest past ``retain``
        messages or ``retain_bytes`` of payload."""
        config, kept = self.config, self.retained
        if not config.retain:
            return
        kept.append(record)
        self.retained_bytes += len(record[1])
        while len(kept) > config.retain or self.retained_bytes > config.retain_bytes:
            self.retained_bytes -= len(kept.popleft()[1])

    def route(self, topic: str) -> list[Group]:
        """The groups whose pattern matches ``topic`` (remembered for the next publish)."""
        routes = self.routes
        groups = routes.get(topic)
        if groups is None:
            groups = [g for g in self.groups.values() if matches(g.pattern, topic)]
            if len(routes) >= _MAX_ROUTES:
                routes.clear()  # topics made per id must not grow the hub without end
            routes[topic] = groups
        return groups


hubs: dict[str, Hub] = {}
"""The live hubs of this process by name: a hub goes with the last broker using it."""
