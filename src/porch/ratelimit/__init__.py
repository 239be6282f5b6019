"""Rate limiting: durable, exact limits decided by the store, through the key pool.

:class:`Limit`, :class:`Concurrency` and :class:`Rule` say what is limited (an
algorithm per limit; a cost per request, settled after the response with
:func:`settle`; levels of keys; plans); :class:`RateLimitMiddleware` (pure ASGI)
sends each selected request's hit to the shard owning its client key and answers
with the store's decision.
"""

from ._costs import CostRequest, settle
from ._decisions import HeaderStyle, PolicyState, Refusal
from ._middleware import Exemption, RateLimitMiddleware, RefusalFactory
from ._rules import (
    RATE_GRAMMAR,
    Concurrency,
    CostFunc,
    LevelKey,
    Limit,
    PlanFunc,
    Plans,
    Rule,
)

__all__ = [
    "RATE_GRAMMAR",
    "Concurrency",
    "CostFunc",
    "CostRequest",
    "Exemption",
    "HeaderStyle",
    "LevelKey",
    "Limit",
    "PlanFunc",
    "Plans",
    "PolicyState",
    "RateLimitMiddleware",
    "Refusal",
    "RefusalFactory",
    "Rule",
    "settle",
]
