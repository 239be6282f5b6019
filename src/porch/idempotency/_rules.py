"""Which requests the idempotency middleware honours ``Idempotency-Key`` on, and how."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._paths import normalize_method, path_matches
from ..errors import ConfigurationError
from ._policy import IdempotencyPolicy, header_names

__all__ = ["IdempotencyRule", "select"]


@dataclass(frozen=True, slots=True, init=False)
class IdempotencyRule:
    """Which requests honour ``Idempotency-Key`` — a path prefix and methods — and how:
    ``policy`` (default: the middleware's).

    ``required`` and ``digest_headers`` are the policy's, given here alone (kept from
    before policies): set, they change the policy this rule gets; ``None``: as the policy
    says. ``required`` → 400 for a selected request that has no key; ``digest_headers``
    names request headers that change a request's meaning (an account header, say),
    digested with ``Content-Type``.
    """

    path: str
    methods: frozenset[str]
    policy: IdempotencyPolicy | None
    required: bool | None
    digest_headers: tuple[bytes, ...] | None

    def __init__(
        self,
        path: str = "/",
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        policy: IdempotencyPolicy | None = None,
        required: bool | None = None,
        digest_headers: Iterable[str] | None = None,
    ) -> None:
        if not path.startswith("/"):
            raise ConfigurationError(f"idempotency rule path must start with '/', got {path!r}")
        methods = frozenset(normalize_method(m) for m in methods)
        if not methods:
            raise ConfigurationError("an idempotency rule needs at least one method")
        if policy is not None and not isinstance(policy, IdempotencyPolicy):
            raise ConfigurationError(f"policy must be an IdempotencyPolicy, got {policy!r}")
        object.__setattr__(self, "path", path.rstrip("/") or "/")
        object.__setattr__(self, "methods", methods)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "required", None if required is None else bool(required))
        object.__setattr__(
            self, "digest_headers", None if digest_headers is None else header_names(digest_headers)
        )

    def resolve(self, default: IdempotencyPolicy) -> IdempotencyPolicy:
        """The policy requests selected by this rule get (``default``: the middleware's)."""
        policy = self.policy if self.policy is not None else default
        changes: dict[str, object] = {}
        if self.required is not None and self.required != policy.required:
            changes["required"] = self.required
        if self.digest_headers is not None and self.digest_headers != policy.digest_headers:
            changes["digest_headers"] = self.digest_headers
        return policy.replace(**changes) if changes else policy


def select(
    rules: Sequence[tuple[IdempotencyRule, IdempotencyPolicy]], method: str, path: str
) -> IdempotencyPolicy | None:
    """The policy of the first rule selecting ``method`` on ``path`` (method already
    normalized), or None."""
    for rule, policy in rules:
        if method in rule.methods and path_matches(rule.path, path):
            return policy
    return None
