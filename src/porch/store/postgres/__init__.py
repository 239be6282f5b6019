"""The PostgreSQL store for several hosts (needs ``pip install 'porch[postgres]'``)."""

from .store import PostgresStore

__all__ = ["PostgresStore"]
