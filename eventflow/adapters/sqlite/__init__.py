"""SQLite adapters (the durable embedded default): one connection, one worker thread."""

from .db import SqliteDatabase
from .store import SqliteStore

__all__ = ("SqliteDatabase", "SqliteStore")
