"""Idempotent replay of unsafe requests: one execution per caller-scoped key.

:class:`IdempotencyMiddleware` (pure ASGI) claims a keyed request's key through
the key pool and the store, runs the handler once, stores its response and
replays it byte for byte to every duplicate; :class:`CallerScope` keeps one
caller's keys apart from another's. An :class:`IdempotencyPolicy` per rule says how
(lifetime, stored statuses, waiting or 409, the fingerprint: see ``_fingerprints``).
:func:`idempotent_function` gives jobs and webhook consumers the same guarantee.
"""

from ._fingerprints import (
    BodyBytes,
    Fingerprint,
    FingerprintFunc,
    FunctionFingerprint,
    JSONFingerprint,
)
from ._functions import Codec, IdempotentFunction, JSONCodec, idempotent_function
from ._keys import CallerScope, ScopeFunc, authorization_scope
from ._middleware import IdempotencyMiddleware
from ._policy import Concurrent, IdempotencyPolicy
from ._rules import IdempotencyRule

__all__ = [
    "BodyBytes",
    "CallerScope",
    "Codec",
    "Concurrent",
    "Fingerprint",
    "FingerprintFunc",
    "FunctionFingerprint",
    "IdempotencyMiddleware",
    "IdempotencyPolicy",
    "IdempotencyRule",
    "IdempotentFunction",
    "JSONCodec",
    "JSONFingerprint",
    "ScopeFunc",
    "authorization_scope",
    "idempotent_function",
]
