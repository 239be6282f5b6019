"""The Redis store (``pip install 'porch[redis]'``): several app hosts on one Redis server.

Importing this package needs no driver; constructing :class:`RedisStore` does.
"""

from .store import RedisStore

__all__ = ["RedisStore"]
