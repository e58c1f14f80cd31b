"""Projections: read models built from the event store, live or by rebuild.

``Projection`` declares the handlers (``@on``) and the ``reset`` hook; ``ProjectionRunner``
feeds it (one active instance per name across processes, checkpoint committed with the
projection's writes) and rebuilds it. See ``docs/projections.md``.
"""

from .projection import (
    Projection,
    ProjectionContext,
    ProjectionError,
    ProjectionLockedError,
    lock_name,
)
from .runner import (
    DEFAULT_BATCH_SIZE,
    ProgressCallback,
    ProjectionHandlerError,
    ProjectionRunner,
    ProjectionStatus,
)

__all__ = (
    "DEFAULT_BATCH_SIZE",
    "ProgressCallback",
    "Projection",
    "ProjectionContext",
    "ProjectionError",
    "ProjectionHandlerError",
    "ProjectionLockedError",
    "ProjectionRunner",
    "ProjectionStatus",
    "lock_name",
)
