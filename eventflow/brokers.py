"""``open_broker(url)``: build a broker adapter from a URL.

``memory://[name]``, ``nats://host:4222``, ``kafka://host:9092[,host2:9092]``. The adapter
modules are imported only when their scheme is used, so a missing driver is reported then,
naming the extra to install.
"""

from __future__ import annotations

from .errors import ConfigurationError
from .ports import Broker
from .urls import redact_url, url_scheme

__all__ = ["open_broker"]


def _memory(url: str) -> Broker:
    from .adapters.memory.broker import MemoryBroker

    return MemoryBroker.from_url(url)


def _nats(url: str) -> Broker:
    from .adapters.nats import NatsBroker

    return NatsBroker.from_url(url)


def _kafka(url: str) -> Broker:
    from .adapters.kafka import KafkaBroker

    return KafkaBroker.from_url(url)


_SCHEMES = {"memory": _memory, "nats": _nats, "kafka": _kafka}


def open_broker(url: str | Broker) -> Broker:
    """Return an (unstarted) broker for ``url``; an adapter instance is returned as is."""
    if not isinstance(url, str):
        return url
    scheme = url_scheme(url)
    factory = _SCHEMES.get(scheme)
    if factory is None:
        raise ConfigurationError(
            f"unsupported broker URL {redact_url(url)!r}: use memory://, nats://host:4222 or kafka://host:9092"
        )
    return factory(url)
