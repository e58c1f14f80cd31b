"""Sagas: one business transaction across services, with compensations (DESIGN section 5).

One job per module: :mod:`~eventflow.sagas.definition` (declaring),
:mod:`~eventflow.sagas.control` (where a saga is, typed), :mod:`~eventflow.sagas.machine`
(the inputs) and :mod:`~eventflow.sagas.progress` (going on after one) of the state
machine, :mod:`~eventflow.sagas.outcome` (what an input did),
:mod:`~eventflow.sagas.commands` (its envelopes), :mod:`~eventflow.sagas.handling` (one
input in a store transaction), :mod:`~eventflow.sagas.persistence` (streams, index,
timers) and :mod:`~eventflow.sagas.runtime` (handlers, timer loop, ``app.sagas``).
"""

from .control import STATUSES
from .definition import Saga, on_timer, step
from .machine import Transition
from .persistence import IndexRow
from .runtime import Sagas

__all__ = ["STATUSES", "IndexRow", "Saga", "Sagas", "Transition", "on_timer", "step"]
