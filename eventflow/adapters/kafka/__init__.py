"""The Kafka broker adapter (aiokafka): ``kafka://host:9092[,host2:9092][?options]``.

``KafkaBroker`` implements :class:`eventflow.ports.Broker`; ``KafkaBrokerConfig`` holds its
settings. Requires the ``kafka`` extra (``pip install 'eventflow[kafka]'``).
"""

from __future__ import annotations

try:
    import aiokafka  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    from ...errors import MissingDependencyError

    raise MissingDependencyError("aiokafka", "kafka") from exc

from .broker import KafkaBroker
from .config import KafkaBrokerConfig

__all__ = ("KafkaBroker", "KafkaBrokerConfig")
