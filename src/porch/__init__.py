"""porch: durable, exact rate limiting and idempotent replay for ASGI applications."""

from .clock import Clock, ManualClock, SystemClock
from .errors import (
    ConfigurationError,
    PoolClosedError,
    PorchError,
    SaturatedError,
    StoreError,
)
from .identity import ClientIdentity, KeyFunc
from .mailbox import Mailbox, MailboxStatistics
from .pool import KeyPool, PoolStatistics
from .ratelimit import PolicyState, RateLimitMiddleware, Refusal, RefusalFactory
from .rules import Limit, Rule
from .store import Durability, SQLiteStore, Store, StoreStatistics

__version__ = "0.1.0"

__all__ = [
    "ClientIdentity",
    "Clock",
    "ConfigurationError",
    "Durability",
    "KeyFunc",
    "KeyPool",
    "Limit",
    "Mailbox",
    "MailboxStatistics",
    "ManualClock",
    "PolicyState",
    "PoolClosedError",
    "PoolStatistics",
    "PorchError",
    "RateLimitMiddleware",
    "Refusal",
    "RefusalFactory",
    "Rule",
    "SQLiteStore",
    "SaturatedError",
    "Store",
    "StoreError",
    "StoreStatistics",
    "SystemClock",
    "__version__",
]
