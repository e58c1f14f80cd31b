"""Projections: read models built from the event store, live or by rebuild.

``Projection`` declares the handlers (``@on``) and the ``setup`` and ``reset`` hooks;
``ProjectionRunner`` feeds it (one active instance per name across processes, under a store
lease; checkpoint committed with the projection's writes, fenced by that lease) and rebuilds
it. See ``docs/projections.md``.
"""

from .projection import (
    Projection,
    ProjectionContext,
    ProjectionError,
    ProjectionLockedError,
    lease_name,
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
    "lease_name",
)
