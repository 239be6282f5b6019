"""The Redis stores (``pip install 'porch[redis]'``): several app hosts on one Redis server
(:class:`RedisStore`) or on a Redis Cluster (:class:`RedisClusterStore`).

Importing this package needs no driver; constructing :class:`RedisStore` does.
"""

from .cluster import RedisClusterStore
from .store import RedisStore

__all__ = ["RedisClusterStore", "RedisStore"]
