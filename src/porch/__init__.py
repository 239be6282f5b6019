"""porch: durable, exact rate limiting and idempotent replay for ASGI applications."""

from .clock import Clock, ManualClock, SystemClock
from .errors import (
    ConfigurationError,
    ForwardingHeaderError,
    KeyInProgressError,
    KeyReusedError,
    PoolClosedError,
    PorchError,
    RateLimitExceeded,
    SaturatedError,
    StoreError,
    UnidentifiedCallerError,
)
from .idempotency import (
    CallerScope,
    IdempotencyMiddleware,
    IdempotencyPolicy,
    IdempotencyRule,
    JSONFingerprint,
    ScopeFunc,
    authorization_scope,
    idempotent_function,
)
from .identity import ClientIdentity, KeyFunc
from .metrics import PorchMetrics
from .pool import KeyPool, Mailbox, MailboxStatistics, PoolStatistics
from .ratelimit import (
    Concurrency,
    Exemption,
    Limit,
    PolicyState,
    RateLimitMiddleware,
    Refusal,
    RefusalFactory,
    Rule,
)
from .store import (
    Durability,
    Quota,
    SQLiteStore,
    Store,
    StoredResponse,
    StoreStatistics,
    open_store,
)

__version__ = "0.1.0"

__all__ = [
    "CallerScope",
    "ClientIdentity",
    "Clock",
    "Concurrency",
    "ConfigurationError",
    "Durability",
    "Exemption",
    "ForwardingHeaderError",
    "IdempotencyMiddleware",
    "IdempotencyPolicy",
    "IdempotencyRule",
    "JSONFingerprint",
    "KeyFunc",
    "KeyInProgressError",
    "KeyPool",
    "KeyReusedError",
    "Limit",
    "Mailbox",
    "MailboxStatistics",
    "ManualClock",
    "PolicyState",
    "PoolClosedError",
    "PoolStatistics",
    "PorchError",
    "PorchMetrics",
    "Quota",
    "RateLimitExceeded",
    "RateLimitMiddleware",
    "Refusal",
    "RefusalFactory",
    "Rule",
    "SQLiteStore",
    "SaturatedError",
    "ScopeFunc",
    "Store",
    "StoreError",
    "StoreStatistics",
    "StoredResponse",
    "SystemClock",
    "UnidentifiedCallerError",
    "__version__",
    "authorization_scope",
    "idempotent_function",
    "open_store",
]
