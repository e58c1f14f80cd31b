"""Sagas: one business transaction across services, with compensations (DESIGN section 5).

See :mod:`eventflow.sagas.definition` (declaring), :mod:`eventflow.sagas.machine` (the
state machine), :mod:`eventflow.sagas.persistence` (streams, index, timers) and
:mod:`eventflow.sagas.runtime` (handlers, timer loop, ``app.sagas``).
"""

from .control import STATUSES
from .definition import Saga, on_timer, step
from .machine import Transition
from .persistence import IndexRow
from .runtime import Sagas

__all__ = ["STATUSES", "IndexRow", "Saga", "Sagas", "Transition", "on_timer", "step"]
