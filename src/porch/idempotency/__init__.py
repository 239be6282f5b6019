"""Idempotent replay of unsafe requests: one execution per caller-scoped key.

:class:`IdempotencyMiddleware` (pure ASGI) claims a keyed request's key through
the key pool and the store, runs the handler once, stores its response and
replays it byte for byte to every duplicate; :class:`CallerScope` keeps one
caller's keys apart from another's.
"""

from ._keys import CallerScope, ScopeFunc, authorization_scope
from ._middleware import IdempotencyMiddleware
from ._rules import IdempotencyRule

__all__ = [
    "CallerScope",
    "IdempotencyMiddleware",
    "IdempotencyRule",
    "ScopeFunc",
    "authorization_scope",
]
