"""PostgreSQL adapters (asyncpg): the event store and everything that shares its pool."""

from .db import PostgresConfig, PostgresDatabase, PostgresTransaction
from .store import PostgresStore

__all__ = ("PostgresConfig", "PostgresDatabase", "PostgresStore", "PostgresTransaction")
