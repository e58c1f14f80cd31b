"""Event sourcing: aggregates rebuilt from their streams, repositories and snapshots."""

from .aggregate import Aggregate
from .on import on
from .repository import Repository

__all__ = ("Aggregate", "Repository", "on")
