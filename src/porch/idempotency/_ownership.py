"""Idempotency on the key pool: the four outcomes, decided by the shard that owns the key.

A keyed request sends :class:`Acquire` and gets one of: the stored response
(digest matches), a mismatch (digest differs), ownership (nothing stored,
nobody running), or :class:`QuotaFull` (its response could not be stored: the
claim that would have reserved room for it was refused, so the handler must not
run). If an owner is running — in this process or in another one
sharing the store — it gets nothing yet: it stays parked in the shard's
volatile state until the owner reports. That state dies with the process, so
a crash never wedges a key.

The shard speaks to the store only through the seam's ops, in its batch:
the first caller's :class:`~porch.store.base.Claim` takes the key (with a
fence token) or finds its stored response or finds it held elsewhere; then
parked callers wait on ``store.claims.watch`` (no polling) and claim again
when it fires. The owner's :class:`Complete` is a fenced
:class:`~porch.store.base.Save` or a :class:`~porch.store.base.Release`: the
one path that ends a claim. Saved → every waiter gets the response; anything
else (released, fenced, over quota, failed) → the waiters still waiting claim
again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

from ..errors import ConfigurationError, PoolClosedError, StoreError
from ..pool._shard import Call, Shard
from ..store.base import Claim, Quota, QuotaBucket, Release, Save, StoredResponse, StoreOp

__all__ = [
    "NO_RESERVATION",
    "OWNER",
    "Acquire",
    "Complete",
    "Mismatch",
    "Outcome",
    "QuotaFull",
    "Report",
    "Reservation",
    "check_quota",
]

logger = logging.getLogger("porch.idempotency")


class _Owner:
    """The caller owns the key: run the handler and report with Complete (``Acquire.token``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OWNER"


OWNER = _Owner()


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key holds a response for a different request (digest differs)."""

    stored_digest: bytes


@dataclass(frozen=True, slots=True)
class QuotaFull:
    """The key's response could not be stored: ``bucket``'s quota is full. Nothing was
    taken, so the handler must not run (a retry would run it again)."""

    bucket: QuotaBucket


@dataclass(frozen=True, slots=True)
class Reservation:
    """What a keyed request's claim reserves (see ``Claim``): room for its response in its
    caller's ``scope``, its ``client``'s and the store's quotas."""

    scope: str
    client: str
    quota: Quota | None
    reserve: int

    def claim(self, key: str) -> Claim:
        return Claim(
            key, scope=self.scope, client=self.client, quota=self.quota, reserve=self.reserve
        )


NO_RESERVATION = Reservation("", "", None, 0)


def check_quota(quota: object, max_stored: int) -> None:
    """Raise ConfigurationError unless ``quota`` is a Quota whose caps each hold at least
    one reservation of ``max_stored`` bytes (every keyed request reserves that much)."""
    if not isinstance(quota, Quota):
        raise ConfigurationError("quota must be a porch Quota")
    for name in ("scope_bytes", "client_bytes", "total_bytes"):
        cap = getattr(quota, name)
        if cap < 1:
            raise ConfigurationError(f"quota.{name} must be >= 1, got {cap}")
    if quota.total_bytes < max(quota.scope_bytes, quota.client_bytes):
        raise ConfigurationError(
            f"quota.total_bytes must be >= quota.scope_bytes and quota.client_bytes"
            f" ({max(quota.scope_bytes, quota.client_bytes)}), got {quota.total_bytes}"
        )
    smallest = min(quota.scope_bytes, quota.client_bytes)
    if smallest < max_stored:
        raise ConfigurationError(
            f"every cap of quota must hold max_stored={max_stored} bytes (a keyed request"
            f" reserves that much before it runs), got {smallest}: raise the quota or lower"
            " max_stored"
        )


Outcome = StoredResponse | Mismatch | QuotaFull | _Owner
Report = Literal["saved", "fenced", "quota", "released"]
"""What became of an owner's report (see ``Save.outcome``); ``released``: not stored."""


class _InFlight:
    """A key being claimed, run or waited for in this process: its waiters and its claim."""

    __slots__ = ("cancel", "key", "reservation", "shard", "token", "waiters")

    def __init__(self, shard: Shard, key: str, reservation: Reservation) -> None:
        self.shard = shard
        self.key = key
        self.reservation = reservation  # the first caller's: every claim of the key makes it
        self.waiters: deque[Acquire] = deque()
        self.token = 0  # > 0 while an owner in this process holds the claim
        self.cancel: Callable[[], None] | None = None  # set while watching a claim elsewhere

    def current(self) -> bool:
        return self.shard.parked.get(self.key) is self

    def forget(self) -> None:
        if self.current():
            del self.shard.parked[self.key]

    def live(self) -> bool:
        return any(not w.future.done() for w in self.waiters)

    def waiting(self) -> int:
        return len(self.waiters)

    def claim_committed(self, claim: Claim, carrier: Acquire | None) -> None:
        """The batch with this key's Claim committed: answer, hand ownership, or watch."""
        if claim.stored is not None:
            self.forget()
            self.resolve(claim.stored)
        elif claim.over is not None:
            # Its response could not be stored: nobody runs the handler for it now.
            self.forget()
            self.refuse(QuotaFull(claim.over))
        elif claim.token:
            self.token = claim.token
            while self.waiters:
                waiter = self.waiters.popleft()
                waiter.state = None
                # A waiter past its deadline (or whose client left) is done already.
                if not waiter.future.done():
                    waiter.token = claim.token
                    waiter.future.set_result(OWNER)
                    return
            self.report(Release(self.key, claim.token))  # nobody left to own it
        elif not self.live():
            self.forget()
        else:
            # Held by another process: park (now the first caller waits too) and watch.
            if carrier is not None and carrier.deadline is None and not carrier.future.done():
                carrier.arm(self)
            try:
                self.cancel = self.shard.store.claims.watch(self.key, self.wake, claim.retry_after)
            except Exception as exc:  # e.g. no thread to spare: fail now, never strand them
                logger.error("porch: cannot wait for an idempotency key's claim: %s", exc)
                self.forget()
                self.close(StoreError(f"cannot wait for the key's claim: {exc}"))

    def wake(self) -> None:
        """The watched claim may be free: claim again (a relook), past any mailbox limit."""
        self.cancel = None
        if self.current():
            self.send(_Relook(self))

    def reclaim(self) -> None:
        """The owner's claim ended without a stored response: the waiters still waiting claim."""
        self.token = 0
        if not self.live():
            self.forget()
        else:
            self.send(_Relook(self))

    def report(self, op: Save | Release) -> None:
        future: asyncio.Future[Report] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self.send(Complete(future, op))

    def send(self, call: Call) -> None:
        try:
            self.shard.mailbox.send_nowait(call, force=True)
        except PoolClosedError as exc:
            self.forget()
            self.close(exc)

    def resolve(self, stored: StoredResponse) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            waiter.state = None
            if not waiter.future.done():
                waiter.future.set_result(_answer(stored, waiter.digest))

    def refuse(self, outcome: QuotaFull) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            waiter.state = None
            if not waiter.future.done():
                waiter.future.set_result(outcome)

    def close(self, exc: BaseException) -> None:
        """Fail whoever waits here (the pool is closing, or the claim failed)."""
        if self.cancel is not None:
            self.cancel()
            self.cancel = None
        while self.waiters:
            waiter = self.waiters.popleft()
            waiter.state = None
            if not waiter.future.done():
                waiter.future.set_exception(exc)


def _answer(stored: StoredResponse, digest: bytes) -> StoredResponse | Mismatch:
    return stored if stored.digest == digest else Mismatch(stored.digest)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Acquire(Call):
    """Ask for a key: stored response, mismatch, ownership, or park until the owner reports.

    An owner finds its fence token in ``token``. A call that has to wait
    (behind an owner here or elsewhere) fails with TimeoutError after
    ``timeout`` seconds, and leaves the waiter list at once.
    """

    __slots__ = (
        "claim",
        "deadline",
        "digest",
        "key",
        "reservation",
        "state",
        "timeout",
        "token",
    )

    def __init__(
        self,
        future: asyncio.Future[Outcome],
        key: str,
        digest: bytes,
        timeout: float,
        reservation: Reservation = NO_RESERVATION,
    ) -> None:
        super().__init__(future)
        self.key = key
        self.digest = digest
        self.timeout = timeout
        self.reservation = reservation
        self.token = 0
        self.claim: Claim | None = None
        self.state: _InFlight | None = None  # where it waits, while it waits
        self.deadline: asyncio.TimerHandle | None = None

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        state = cast("_InFlight | None", shard.parked.get(self.key))
        if state is not None:
            state.waiters.append(self)  # answered once the key's claim is decided
            self.arm(state)
            return
        # The first caller is the first waiter: the claim's outcome answers it
        # like everyone parked behind it meanwhile (see _InFlight.claim_committed).
        state = _InFlight(shard, self.key, self.reservation)
        shard.parked[self.key] = state
        state.waiters.append(self)
        self.claim = self.reservation.claim(self.key)
        ops.append(self.claim)

    @property
    def waited(self) -> bool:
        """Whether this call waited behind another holder of its key (here or elsewhere)."""
        return self.deadline is not None

    def arm(self, state: _InFlight) -> None:
        # Only a waiting call pays for a timer: the common first caller never waits.
        self.state = state
        self.deadline = self.future.get_loop().call_later(self.timeout, self._expire)
        self.future.add_done_callback(self._done)

    def _expire(self) -> None:
        self._leave()
        if not self.future.done():
            self.future.set_exception(TimeoutError())

    def _done(self, _: object) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self._leave()  # e.g. its client left

    def _leave(self) -> None:
        state = self.state
        if state is None:  # answered by the shard already
            return
        self.state = None
        try:
            state.waiters.remove(self)
        except ValueError:
            return
        if state.cancel is not None and not state.live():
            # Only watching another process's claim, and nobody waits any more.
            state.cancel()
            state.cancel = None
            state.forget()

    def finish(self, shard: Shard) -> None:
        claim = self.claim
        if claim is not None:
            state = cast("_InFlight | None", shard.parked.get(self.key))
            if state is not None:
                state.claim_committed(claim, self)

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        super().fail(shard, exc)
        if shard is not None and self.claim is not None:
            # The claim failed: nobody owns the key, and those parked behind it fail too.
            state = cast("_InFlight | None", shard.parked.pop(self.key, None))
            if state is not None:
                state.close(exc)


class _Relook(Call):
    """The key's claim may have come free (its holder finished or died): claim again."""

    __slots__ = ("claim", "state")

    def __init__(self, state: _InFlight) -> None:
        # Nobody awaits a relook: its outcome goes to the waiters it is for.
        super().__init__(asyncio.get_running_loop().create_future())
        self.state = state
        self.claim: Claim | None = None

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        state = self.state
        if not state.current():
            return
        if not state.live():  # everyone waiting gave up meanwhile
            state.forget()
            return
        self.claim = state.reservation.claim(state.key)
        ops.append(self.claim)

    def finish(self, shard: Shard) -> None:
        if self.claim is not None and self.state.current():
            self.state.claim_committed(self.claim, None)

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        if self.state.current():
            self.state.forget()
            self.state.close(exc)


class Complete(Call):
    """The owner's report: a fenced :class:`Save` of its response, or a :class:`Release`.

    The future gets what became of it (:data:`Report`) once committed.

    A save of a big body (above the store's ``Capabilities.solo_save_bytes``) leaves the
    shard's batch: it is applied on its own while the shard answers that batch and goes on to the
    next, so other callers' decisions never wait for it in the shard (the store
    then commits it apart from them, see ``store/sqlite/upkeep.FairBatches``).
    Nothing about its key moves meanwhile: the key stays parked on its owner
    until the save commits (callers who come for it wait), so only other keys'
    operations pass it.
    """

    __slots__ = ("alone", "op")

    def __init__(self, future: asyncio.Future[Report], op: Save | Release) -> None:
        super().__init__(future)
        self.op = op
        self.alone = False  # applied on its own: the shard's finish and fail are not its own

    @classmethod
    def of(
        cls,
        future: asyncio.Future[Report],
        key: str,
        token: int,
        response: StoredResponse | None,
        ttl: float,
        scope: str = "",
        quota: Quota | None = None,
        client: str = "",
    ) -> Complete:
        if response is None:
            return cls(future, Release(key, token, scope=scope, client=client))
        return cls(
            future,
            Save(key, response, ttl, token=token, scope=scope, client=client, quota=quota),
        )

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        op = self.op
        solo = shard.solo_save_bytes
        if solo is not None and type(op) is Save and len(op.response.body) > solo:
            self.alone = True
            shard.run_aside(self._apply_alone(shard))
            return
        ops.append(op)

    async def _apply_alone(self, shard: Shard) -> None:
        metrics = shard.metrics
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await shard.store.apply([self.op])
        except Exception as exc:
            self._failed(shard, shard.store_error(exc))
            return
        if metrics is not None:
            metrics.committed(loop.time() - started, 1)
        self._finished(shard)

    def finish(self, shard: Shard) -> None:
        if not self.alone:
            self._finished(shard)

    def fail(self, shard: Shard | None, exc: BaseException) -> None:
        if not self.alone:
            self._failed(shard, exc)

    def _finished(self, shard: Shard) -> None:
        # Committed: only now may waiters be told (or claim again).
        op = self.op
        outcome: Report = "released" if isinstance(op, Release) else cast(Report, op.outcome)
        state = cast("_InFlight | None", shard.parked.get(op.key))
        if state is not None and state.token == op.token:
            if isinstance(op, Save) and outcome == "saved":
                state.forget()
                state.resolve(op.response)
            else:
                state.reclaim()
        if not self.future.done():
            self.future.set_result(outcome)

    def _failed(self, shard: Shard | None, exc: BaseException) -> None:
        super().fail(shard, exc)
        if shard is not None:
            # Not stored (SQLite ended the claim with the failed transaction; a lease
            # store renews it no more, so it lapses): the waiters claim again, and get
            # the store's answer then.
            state = cast("_InFlight | None", shard.parked.get(self.op.key))
            if state is not None and state.token == self.op.token:
                state.reclaim()
