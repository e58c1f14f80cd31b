"""PostgreSQL adapters (asyncpg): the event store and everything that shares its pool."""

from .db import PostgresConfig, PostgresDatabase, PostgresTransaction
from .sagas import PostgresSagaTables  # importing it registers the store's saga tables
from .store import PostgresStore

__all__ = (
    "PostgresConfig",
    "PostgresDatabase",
    "PostgresSagaTables",
    "PostgresStore",
    "PostgresTransaction",
)
