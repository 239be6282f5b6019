"""Durable stores: the seam and its backends."""

from .base import Durability, Hit, Lookup, Save, Store, StoredResponse, StoreOp, StoreStatistics
from .sqlite import SQLiteStore

__all__ = [
    "Durability",
    "Hit",
    "Lookup",
    "SQLiteStore",
    "Save",
    "Store",
    "StoreOp",
    "StoreStatistics",
    "StoredResponse",
]
