"""A store over several PostgreSQL servers or standalone Redis primaries, each key at one home.

Importing this package needs no driver; its stores' classes do. See
docs/stores/sharding.md for what it decides where, and how to add a server.
"""

from .homes import rendezvous
from .store import ShardedStore

__all__ = ["ShardedStore", "rendezvous"]
