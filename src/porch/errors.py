"""Every exception porch raises, in one place."""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "ForwardingHeaderError",
    "PoolClosedError",
    "PorchError",
    "SaturatedError",
    "StoreError",
]


class PorchError(Exception):
    """Raised when porch fails; the base of every porch exception."""


class ConfigurationError(PorchError, ValueError):
    """Raised when a porch object is constructed with an invalid setting."""


class ForwardingHeaderError(PorchError):
    """Raised when a forwarding header's trusted entries cannot be read; the request gets 400."""


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
