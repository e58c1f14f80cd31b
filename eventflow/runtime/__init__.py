"""The consumer runtime: dispatch, retry, dead letters, timeouts, shutdown, heartbeat.

``consumer`` wires one subscription's consumer from ``dispatch`` (the keyed dispatcher:
fetch window, lanes, workers), ``pipeline`` (one delivery from bytes to ack), ``watchdog``
(handler timeouts) and ``settlement`` (a handler's inbox transaction); it needs of its app
only ``host.ConsumerHost``. ``relay`` sends the outbox, ``heartbeat`` records liveness,
``deadletters`` inspects and replays dead letters.
"""

from .retry import RetryPolicy

__all__ = ("RetryPolicy",)
