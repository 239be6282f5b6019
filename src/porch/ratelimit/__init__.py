"""Rate limiting: durable, exact limits decided by the store, through the key pool.

:class:`Limit`, :class:`Concurrency` and :class:`Rule` say what is limited;
:class:`RateLimitMiddleware` (pure ASGI) sends each selected request's hit to
the shard owning its client key and answers with the store's decision.
"""

from ._decisions import HeaderStyle, PolicyState, Refusal
from ._middleware import Exemption, RateLimitMiddleware, RefusalFactory
from ._rules import Concurrency, Limit, Rule

__all__ = [
    "Concurrency",
    "Exemption",
    "HeaderStyle",
    "Limit",
    "PolicyState",
    "RateLimitMiddleware",
    "Refusal",
    "RefusalFactory",
    "Rule",
]
