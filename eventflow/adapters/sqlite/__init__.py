"""SQLite adapters (the durable embedded default): one connection, one worker thread."""

from .db import SqliteDatabase
from .sagas import SqliteSagaTables  # importing it registers the store's saga tables
from .store import SqliteStore

__all__ = ("SqliteDatabase", "SqliteSagaTables", "SqliteStore")
