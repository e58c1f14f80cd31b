"""NATS JetStream broker adapter (``nats://host:4222``); needs ``pip install 'eventflow[nats]'``.

See ``docs/nats.md`` for how streams, subjects and consumers are named, the settings and
the guarantees.
"""

from __future__ import annotations

from .broker import NatsBroker
from .config import NatsBrokerConfig

__all__ = ["NatsBroker", "NatsBrokerConfig"]
