"""``ConsumerHost``: what a consumer and a handler's ``Context`` need of the app that runs them.

A small Protocol instead of ``App`` itself, so the runtime and the context depend on a
port, not on the module that wires them (``eventflow.app`` imports the runtime; nothing in
the runtime imports it back). ``App`` satisfies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..envelope import Envelope
from ..events import EventRegistry
from ..limits.registry import Limits
from ..ports import Broker, DedupStore, Store

__all__ = ["ConsumerHost"]


class ConsumerHost(Protocol):
    """The app a consumer runs in: its name, broker, store, dedup store and registry, and
    how messages a handler published are sent."""

    @property
    def name(self) -> str:
        """The app's name: the ``source`` of the envelopes its handlers publish."""

    @property
    def broker(self) -> Broker:
        """The broker the consumer subscribes on."""

    @property
    def store(self) -> Store:
        """The store: dead letters, attempt records, the handler's transaction, the outbox."""

    @property
    def dedup(self) -> DedupStore:
        """The dedup store of idempotent handlers (the store's own table, or a separate one)."""

    @property
    def registry(self) -> EventRegistry:
        """The event types (and upcasters) messages are decoded with."""

    @property
    def limits(self) -> Limits:
        """The app's declared limits (``ctx.limit(name)``)."""

    async def send_outgoing(self, messages: Sequence[tuple[str, Envelope]]) -> None:
        """Send ``(topic, envelope)`` pairs a handler published, in order, retrying what may
        pass; raise ``MessageRefusedError`` for a message the broker refuses for good."""
