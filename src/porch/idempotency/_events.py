"""What the idempotency middleware counts and logs: refusals, 503s, unstored responses.

Logs are throttled per caller scope and outcome (:class:`~porch.eventlog.EventLog`),
so a client cannot choose the log volume.
"""

from __future__ import annotations

import asyncio
import logging

from .._eventlog import EventLog
from .._types import Scope
from ..errors import ForwardingHeaderError, PorchError, UnidentifiedCallerError
from ..metrics import PorchMetrics
from ..store.base import Quota
from ._keys import ScopeFunc

__all__ = ["IdempotencyEvents"]

logger = logging.getLogger("porch.idempotency")


class IdempotencyEvents:
    """The metrics and throttled log lines of one idempotency middleware."""

    __slots__ = ("_causes", "_scope", "_unstored", "log", "outcomes", "quota")

    def __init__(self, metrics: PorchMetrics | None, scope: ScopeFunc, quota: Quota) -> None:
        self._scope = scope
        self.quota = quota
        self.log = EventLog(logger)
        self.outcomes = metrics.idempotency if metrics is not None else None
        self._causes = metrics.causes if metrics is not None else None
        self._unstored = metrics.unstored if metrics is not None else None

    def event(
        self, scope: Scope, outcome: str, status: int, level: int, message: str, *args: object
    ) -> None:
        """Count ``outcome`` and log it (at most once a second per caller scope and outcome)."""
        if self.outcomes is not None and outcome in self.outcomes:
            self.outcomes[outcome].inc()
        if self._causes is not None and outcome in self._causes:
            self._causes[outcome].inc()
        try:
            caller = self._scope(scope)
        except (ForwardingHeaderError, UnidentifiedCallerError):
            caller = "unidentified"
        except PorchError:  # credentials, before the store (and its secret) was open
            caller = "unknown"
        self.log.event(
            level,
            (outcome, caller),
            asyncio.get_running_loop().time(),
            1.0,
            message,
            *args,
            scope=caller,
            outcome=outcome,
            cause=outcome if status == 503 else None,
            status=status,
            path=scope.get("path"),
        )

    def count_unstored(self, reason: str) -> None:
        if self._unstored is not None:
            self._unstored[reason].inc()

    def over_quota(self, caller: str, client: str, bucket: str, status: int) -> None:
        """A keyed request refused before it ran: its response could not be stored."""
        if self.outcomes is not None:
            self.outcomes["quota"].inc()
        if status == 503 and self._causes is not None:
            self._causes["quota"].inc()
        # A client over its quota must not choose the log volume: once a minute per
        # scope (or client, or the store) whose quota is full.
        owner = {"scope": caller, "client": client, "total": ""}.get(bucket, "")
        self.log.event(
            logging.WARNING,
            ("quota", bucket, owner),
            asyncio.get_running_loop().time(),
            60.0,
            "porch: refused a keyed request before it ran (%d): the %s quota of %r is full"
            " (%d bytes per scope, %d per client, %d in total)",
            status,
            bucket,
            owner[:64] if owner else "the store",
            self.quota.scope_bytes,
            self.quota.client_bytes,
            self.quota.total_bytes,
            scope=caller,
            client=client,
            outcome="quota",
            cause="quota",
            status=status,
        )

    def unstored_over_quota(self, caller: str) -> None:
        """A response sent but not stored: over a quota at its save (it reserved less than
        it needed: a save without a claim, or a store that lost the reservation)."""
        self.count_unstored("quota")
        self.log.event(
            logging.WARNING,
            ("unstored", caller),
            asyncio.get_running_loop().time(),
            60.0,
            "porch: a response of scope %r was sent but not stored: over the quota at its"
            " save; its key released",
            caller[:64],
            scope=caller,
            outcome="quota",
        )
