"""Durable stores: the seam and its backends."""

from .base import Durability, Hit, Store, StoreOp, StoreStatistics
from .sqlite import SQLiteStore

__all__ = ["Durability", "Hit", "SQLiteStore", "Store", "StoreOp", "StoreStatistics"]
