"""Every exception porch raises, in one place."""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigurationError",
    "ForwardingHeaderError",
    "IntegrityError",
    "KeyInProgressError",
    "KeyReusedError",
    "PartialStoreError",
    "PoolClosedError",
    "PorchError",
    "QuotaFullError",
    "RateLimitExceeded",
    "SaturatedError",
    "StoreError",
    "UnidentifiedCallerError",
]


class PorchError(Exception):
    """Raised when porch fails; the base of every porch exception."""


class ConfigurationError(PorchError, ValueError):
    """Raised when a porch object is constructed with an invalid setting."""


class ForwardingHeaderError(PorchError):
    """Raised when a forwarding header's trusted entries cannot be read; the request gets 400."""


class UnidentifiedCallerError(PorchError):
    """Raised when a keyed request has neither credentials nor a client address: no caller
    scope would be its own, so idempotency refuses it (503) rather than share one."""


class KeyReusedError(PorchError):
    """Raised when an idempotent function is called with a key whose stored result is for a
    call with other arguments (HTTP's 422)."""


class KeyInProgressError(PorchError):
    """Raised when an idempotent function's call under a key still running elsewhere waited
    past ``wait_timeout`` (at once with ``concurrent="conflict"``; HTTP's 409)."""


class QuotaFullError(PorchError):
    """Raised when an idempotent function's call is refused before it runs: its result could
    not be stored, because the ``bucket`` quota (``"scope"`` or ``"client"``: the function's
    own; ``"total"``: the store's) is full (HTTP's 429 or 503)."""

    def __init__(self, message: str, bucket: str) -> None:
        super().__init__(message)
        self.bucket = bucket


class IntegrityError(PorchError):
    """Raised when an idempotent function's stored result fails its integrity check (written
    without its ``integrity_key``, or tampered with): it is not returned (HTTP's 503)."""


class RateLimitExceeded(PorchError):
    """Raised when a route-level limit refuses a request and the app handles it (or 429)."""

    def __init__(self, refusal: Any) -> None:
        # Not super(): in a framework subclass the next class is its HTTPException.
        Exception.__init__(self, f"rate limit exceeded; retry in {refusal.retry_after} s")
        self.refusal = refusal
        # As str pairs, the shape framework responses take (Retry-After, X-RateLimit-*, ...).
        self.rate_limit_headers: dict[str, str] = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in refusal.headers
        }


class SaturatedError(PorchError):
    """Raised when a shard's bounded mailbox is full and the call is refused at once."""

    def __init__(self, shard: int, capacity: int) -> None:
        super().__init__(f"shard {shard} mailbox is full ({capacity} queued operations)")
        self.shard = shard
        self.capacity = capacity


class PoolClosedError(PorchError):
    """Raised when a call reaches a key pool that is closed or closing."""


class StoreError(PorchError):
    """Raised when the durable store cannot apply or read operations (locked, full, unreadable)."""


class PartialStoreError(StoreError):
    """Raised when a store applied some of a batch's operations and not the others (a
    sharded store with one server down): ``failed`` holds the positions, in the batch, of
    those that failed; the others were applied and their callers are answered."""

    def __init__(self, message: str, failed: frozenset[int]) -> None:
        super().__init__(message)
        self.failed = failed
