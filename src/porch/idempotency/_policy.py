"""How a keyed request is handled: one frozen, validated policy per idempotency rule.

The same object configures :class:`~porch.IdempotencyMiddleware` (its default
policy and each :class:`~porch.IdempotencyRule`'s), the route-level declarations
(``idempotent(policy=...)``, ``Idempotency(policy=...)``) and, through the
middleware, the WSGI bridge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .._types import Scope
from ..errors import ConfigurationError
from ._capture import TOKEN, storable
from ._fingerprints import Fingerprint, FingerprintSpec, fingerprint_of
from ._keys import scope_digest

__all__ = ["Concurrent", "IdempotencyPolicy", "header_names"]

Concurrent = Literal["wait", "conflict"]
"""What a duplicate that arrives while its owner runs gets: ``"wait"`` — it waits for the
owner's response (at most ``wait_timeout`` seconds, then 409); ``"conflict"`` — 409 at once
(the IETF draft's "SHOULD" for a request still being processed)."""


@dataclass(frozen=True, slots=True, init=False)
class IdempotencyPolicy:
    """Everything that decides how a keyed request is handled, validated once.

    Field by field:
    """

    #: Seconds a stored response is replayed (its key then runs the handler again).
    ttl: float
    #: Seconds a duplicate waits for a running owner (``concurrent="wait"``), then 409.
    wait_timeout: float
    #: A concurrent duplicate waits for the owner's response, or gets 409 at once.
    concurrent: Concurrent
    #: A selected request without ``Idempotency-Key`` is refused with 400 (else it runs).
    required: bool
    #: The response statuses stored for replay; ``None``: 2xx-4xx except 408, 409, 425
    #: and 429 (the ones that say "try again"). Anything else is sent, not stored, and
    #: its key released.
    statuses: frozenset[int] | None
    #: Keyed request bodies over this many bytes are refused with 413.
    max_body: int
    #: Responses over this many bytes are sent, not stored (the key is released).
    max_stored: int
    #: What of the body makes two requests "the same" (see :mod:`porch.idempotency`).
    fingerprint: Fingerprint
    #: Request headers digested with the body (lower-case; ``content-type`` always).
    digest_headers: tuple[bytes, ...]

    def __init__(
        self,
        *,
        ttl: float = 86400.0,
        wait_timeout: float = 30.0,
        concurrent: Concurrent = "wait",
        required: bool = False,
        statuses: Iterable[int] | None = None,
        max_body: int = 1 << 20,
        max_stored: int = 1 << 20,
        fingerprint: FingerprintSpec = "bytes",
        digest_headers: Iterable[str | bytes] = (),
    ) -> None:
        if not ttl > 0:
            raise ConfigurationError(f"ttl must be > 0 seconds, got {ttl}")
        if not wait_timeout > 0:
            raise ConfigurationError(f"wait_timeout must be > 0 seconds, got {wait_timeout}")
        if concurrent not in ("wait", "conflict"):
            raise ConfigurationError(f"concurrent must be 'wait' or 'conflict', got {concurrent!r}")
        if max_body < 0:
            raise ConfigurationError(f"max_body must be >= 0 bytes, got {max_body}")
        if max_stored < 0:
            raise ConfigurationError(f"max_stored must be >= 0 bytes, got {max_stored}")
        kept: frozenset[int] | None = None
        if statuses is not None:
            kept = frozenset(statuses)
            for status in kept:
                if isinstance(status, bool) or not isinstance(status, int):
                    raise ConfigurationError(f"statuses must be integers, got {status!r}")
                if not 200 <= status <= 599:
                    raise ConfigurationError(
                        f"statuses must be final statuses 200-599, got {status}"
                    )
        object.__setattr__(self, "ttl", float(ttl))
        object.__setattr__(self, "wait_timeout", float(wait_timeout))
        object.__setattr__(self, "concurrent", concurrent)
        object.__setattr__(self, "required", bool(required))
        object.__setattr__(self, "statuses", kept)
        object.__setattr__(self, "max_body", int(max_body))
        object.__setattr__(self, "max_stored", int(max_stored))
        object.__setattr__(self, "fingerprint", fingerprint_of(fingerprint))
        object.__setattr__(self, "digest_headers", header_names(digest_headers))

    def replace(self, **changes: object) -> IdempotencyPolicy:
        """A copy with ``changes`` (validated like a new policy)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(changes)
        return IdempotencyPolicy(**fields)

    def stores(self, status: int) -> bool:
        """Whether a response with ``status`` is stored for replay."""
        if self.statuses is None:
            return storable(status)
        return status in self.statuses

    def digest(self, scope: Scope, body: bytes) -> bytes:
        """What makes two requests "the same" under this policy: method, path, query, the
        digest headers and the body's fingerprint."""
        return scope_digest(scope, self.fingerprint(scope, body), self.digest_headers)


def header_names(headers: Iterable[str | bytes]) -> tuple[bytes, ...]:
    """``content-type`` and ``headers``, lower-case, each once; a name that is no header
    name is a ConfigurationError."""
    if isinstance(headers, str | bytes):
        raise ConfigurationError("digest_headers must be a sequence of header names")
    names = [b"content-type"]
    for header in headers:
        raw = header if isinstance(header, bytes) else header.encode("latin-1", "replace")
        name = raw.strip().lower()
        if TOKEN.fullmatch(name) is None:
            raise ConfigurationError(f"digest_headers entry {header!r} is not a header name")
        if name not in names:
            names.append(name)
    return tuple(names)
