"""The idempotency middleware: a resent unsafe request gets the stored response.

Pure ASGI. A keyed request is scoped to its caller, digested, and sent to the
shard that owns the key (see :mod:`porch.ownership`). The owner's response is
captured while it streams to the client — the shape of Starlette's gzip
responder — and reported back; the shard stores it (group commit) and only
then hands it to every parked duplicate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from .._asgi import pass_through, replaying, route_path
from .._paths import normalize_method
from .._responses import BytesResponse, problem
from .._types import ASGIApp, Receive, Scope, Send
from ..errors import (
    ConfigurationError,
    ForwardingHeaderError,
    PoolClosedError,
    SaturatedError,
    StoreError,
    UnidentifiedCallerError,
)
from ..identity import ClientIdentity, KeyFunc
from ..pool._pool import KeyPool
from ..store.base import Quota, StoredResponse
from ._capture import REPLAYED_HEADERS, Capture
from ._events import IdempotencyEvents
from ._integrity import IntegrityKeys
from ._keys import (
    SECRET,
    CallerScope,
    InvalidKey,
    ScopeFunc,
    parse_key,
)
from ._ownership import (
    OWNER,
    Acquire,
    Complete,
    Mismatch,
    Outcome,
    QuotaFull,
    Report,
    Reservation,
    check_quota,
)
from ._policy import IdempotencyPolicy
from ._rules import IdempotencyRule, select

__all__ = ["DEFAULT_QUOTA", "IdempotencyMiddleware", "IdempotencyPolicy", "IdempotencyRule"]

logger = logging.getLogger("porch.idempotency")

DEFAULT_RULE = IdempotencyRule()  # frozen: POST and PATCH on every path, key optional
DEFAULT_QUOTA = Quota()  # frozen: 8 MiB per caller scope, 4 MiB per client, 1 GiB in total


class IdempotencyMiddleware:
    """Replay stored responses for repeated ``Idempotency-Key`` requests; run the handler once.

    ``scope`` names the caller a key belongs to (default: :class:`CallerScope`,
    credentials or else the client identity; no caller sees another's keys).
    ``policy`` (an :class:`IdempotencyPolicy`) says how a keyed request is handled,
    for every rule that names none of its own: how long responses are kept, which
    statuses are stored, whether a concurrent duplicate waits or gets 409, the
    largest body and stored response, the fingerprint. ``ttl``, ``wait_timeout``,
    ``max_body`` and ``max_stored`` are kept from before policies: given, they change
    that policy. Responses are kept ``ttl`` seconds. A duplicate waits for a running
    owner at most ``wait_timeout`` seconds (then 409).
    Keyed bodies over ``max_body`` bytes are refused with 413; responses over
    ``max_stored`` bytes (key, digest, replayed headers and body) are sent but not
    stored, and the key is released as if the owner had failed (the next
    duplicate runs the handler). ``quota`` caps the bytes of live stored
    responses per caller scope, per client identity (``identity``: default, the
    ``CallerScope``'s, else :class:`ClientIdentity`) whatever scopes it presents,
    and in the whole store. Before the handler runs, its claim reserves its
    rule's ``max_stored`` bytes under all three: when one is full the request is
    refused (429, or 503 for the store's), so a handler never runs for a response
    that could not be stored. ``enabled=False`` passes every request through
    untouched and never opens the store (an off switch for tests).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        pool: KeyPool,
        rules: Sequence[IdempotencyRule] | IdempotencyRule = DEFAULT_RULE,
        scope: ScopeFunc | None = None,
        policy: IdempotencyPolicy | None = None,
        ttl: float | None = None,
        wait_timeout: float | None = None,
        max_body: int | None = None,
        max_stored: int | None = None,
        retry_after: int = 1,
        quota: Quota = DEFAULT_QUOTA,
        identity: KeyFunc | None = None,
        integrity_key: bytes | Sequence[bytes] | None = None,
        enabled: bool = True,
    ) -> None:
        rules = (rules,) if isinstance(rules, IdempotencyRule) else tuple(rules)
        if not rules:
            raise ConfigurationError("IdempotencyMiddleware needs at least one IdempotencyRule")
        if not isinstance(pool, KeyPool):
            raise ConfigurationError("pool must be a porch KeyPool")
        if policy is not None and not isinstance(policy, IdempotencyPolicy):
            raise ConfigurationError(f"policy must be an IdempotencyPolicy, got {policy!r}")
        legacy = {
            name: value
            for name, value in (
                ("ttl", ttl),
                ("wait_timeout", wait_timeout),
                ("max_body", max_body),
                ("max_stored", max_stored),
            )
            if value is not None
        }
        base = policy if policy is not None else IdempotencyPolicy()
        policy = base.replace(**legacy) if legacy else base
        if retry_after < 1:
            raise ConfigurationError(f"retry_after must be >= 1 second, got {retry_after}")
        if identity is not None and not callable(identity):
            raise ConfigurationError(f"identity must be a callable(scope) -> str, got {identity!r}")
        self.app = app
        self.pool = pool
        self.enabled = enabled
        self.policy = policy
        # Each rule with the policy it gets, resolved once.
        self._rules = tuple((rule, rule.resolve(policy)) for rule in rules)
        # Every keyed request reserves its rule's max_stored: each cap must hold one.
        check_quota(quota, max(resolved.max_stored for _, resolved in self._rules))
        self._scope: ScopeFunc = scope if scope is not None else CallerScope()
        if identity is None:
            # The caller scope's own identity (the limiter's, when the app gave it one).
            caller = self._scope
            identity = caller.identity if isinstance(caller, CallerScope) else ClientIdentity()
        self._identity: KeyFunc = identity
        # Opt-in: stored responses signed and checked before a replay (see _integrity).
        self.integrity = None if integrity_key is None else IntegrityKeys(integrity_key)
        # Where bodies bigger than a part are streamed to, and replayed from.
        self.parts = pool.store.capabilities.parts
        # The default policy's, as before policies (each rule may say otherwise).
        self.ttl = policy.ttl
        self.wait_timeout = policy.wait_timeout
        self.max_body = policy.max_body
        self.max_stored = policy.max_stored
        # Response header names this middleware's handlers sent, as checked (capture.head).
        self.header_names: dict[bytes, bytes] = {}
        self._retry_after = [(b"retry-after", str(retry_after).encode("ascii"))]
        self.quota = quota
        self.events = IdempotencyEvents(pool.metrics, self._caller, quota)
        self._told_unidentified = False  # what to configure is logged once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await pass_through(self.app, self.pool, scope, receive, send)
            return
        policy = select(self._rules, normalize_method(scope["method"]), route_path(scope))
        if policy is None:
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope["headers"] if k == b"idempotency-key"]
        if not values:
            if policy.required:
                self.events.event(
                    scope,
                    "invalid",
                    400,
                    logging.INFO,
                    "porch: refused a request without an Idempotency-Key (400)",
                )
                await problem(400, "this endpoint requires an Idempotency-Key header")(
                    scope, receive, send
                )
            else:
                await self.app(scope, receive, send)
            return
        try:
            key = parse_key(values)
        except InvalidKey as exc:
            self.events.event(
                scope,
                "invalid",
                400,
                logging.INFO,
                "porch: refused an invalid Idempotency-Key: %s",
                exc,
            )
            await problem(400, str(exc))(scope, receive, send)
            return

        try:
            body = await _read_body(receive, policy.max_body)
        except _BodyTooLarge:
            self.events.event(
                scope,
                "too_large",
                413,
                logging.INFO,
                "porch: refused a keyed body over max_body=%d bytes (413)",
                policy.max_body,
            )
            await problem(413, f"a keyed request body may be at most {policy.max_body} bytes")(
                scope, receive, send
            )
            return
        if body is None:  # the client left while sending
            return
        try:
            digest = policy.digest(scope, body)
        except ValueError as exc:  # the policy's fingerprint function refused the body
            self.events.event(
                scope,
                "invalid",
                400,
                logging.INFO,
                "porch: refused a keyed body its fingerprint cannot read: %s",
                exc,
            )
            await problem(400, f"the request body cannot be fingerprinted: {exc}")(
                scope, receive, send
            )
            return
        try:
            if not self.pool.started:
                await self.pool.start()  # its store's secret keys the caller's digest
            caller = self._caller(scope)
            # Whose quota the response counts against (a key function may be async).
            found = self._identity(scope)
            client = found if isinstance(found, str) else await found
        except (StoreError, PoolClosedError) as exc:
            await self._store_failed(scope, receive, send, exc)
            return
        except ForwardingHeaderError as exc:
            self.events.event(
                scope,
                "invalid",
                400,
                logging.WARNING,
                "porch: refused a request whose caller cannot be identified: %s",
                exc,
            )
            await problem(400, f"the client cannot be identified: {exc}", cause="forwarding")(
                scope, receive, send
            )
            return
        except UnidentifiedCallerError:
            self._unidentified(scope)
            await problem(
                503,
                "idempotency cannot tell this caller from others: the request has no"
                " credentials and the server sees no client address",
                cause="unidentified",
            )(scope, receive, send)
            return
        if "\x1f" in caller:
            # The separator of a scoped key, and what idempotent functions' keys start with
            # (_functions.py): a scope holding it could reach keys that are not its own.
            self.events.event(
                scope,
                "configuration",
                503,
                logging.ERROR,
                "porch: the caller scope function returned a scope holding \\x1f; refused (503)",
            )
            await problem(503, "idempotency is misconfigured", cause="configuration")(
                scope, receive, send
            )
            return
        reservation = Reservation(caller, client, self.quota, policy.max_stored)
        await self._keyed(
            scope, receive, send, policy, reservation, f"{caller}\x1f{key}", digest, body
        )

    def _caller(self, scope: Scope) -> str:
        """The request's caller scope: the scope function, handed the store's secret (in a
        copy of the scope, see idempotency_keys.SECRET) once the store is open."""
        try:
            secret = self.pool.store.secret
        except StoreError:  # not open yet (a log line of an early refusal)
            return self._scope(scope)
        return self._scope({**scope, SECRET: secret})

    async def _store_failed(
        self, scope: Scope, receive: Receive, send: Send, exc: BaseException
    ) -> None:
        self.events.event(
            scope,
            "store",
            503,
            logging.ERROR,
            "porch: idempotency store failed (%s); answering 503",
            exc,
        )
        await problem(
            503, "idempotency store unavailable", cause="store", headers=self._retry_after
        )(scope, receive, send)

    def _unidentified(self, scope: Scope) -> None:
        """Count and log a keyed request refused for want of a caller; say once what to
        configure (a deployment's setting, not a client's mistake)."""
        if not self._told_unidentified:
            self._told_unidentified = True
            logger.error(
                "porch: refusing keyed requests that carry no credentials from a client"
                " without an address (%s): they would all share one idempotency scope. Behind"
                " a proxy on a unix socket, pass ClientIdentity(trusted_proxies=['unix']) to"
                " the limiter and CallerScope(identity=...); in WSGI, have the server set"
                " REMOTE_ADDR; or give IdempotencyMiddleware scope= a function naming the"
                " user",
                "a unix socket" if scope.get("client") is None else "an empty address",
                extra={"outcome": "unidentified", "cause": "unidentified", "status": 503},
            )
        self.events.event(
            scope,
            "unidentified",
            503,
            logging.WARNING,
            "porch: refused a keyed request whose caller cannot be told from others (503)",
        )

    async def _keyed(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        policy: IdempotencyPolicy,
        reservation: Reservation,
        key: str,
        digest: bytes,
        body: bytes,
    ) -> None:
        pool = self.pool
        # "conflict": a duplicate that would wait is answered 409 at once (a zero deadline).
        wait = policy.wait_timeout if policy.concurrent == "wait" else 0.0
        try:
            if not pool.started:
                await pool.start()
            future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
            # Parked behind a running owner costs a parked task, no polling. The
            # shard arms the wait_timeout deadline only if the call has to wait.
            acquire = Acquire(future, key, digest, wait, reservation)
            shard = pool.submit(key, acquire)
            try:
                outcome = await future
            except asyncio.CancelledError:
                # Cancelled just as ownership arrived: the claim must not be left held.
                if future.done() and not future.cancelled() and future.result() is OWNER:
                    self.report_owner(key, acquire.token, reservation, None, shard)
                raise
        except TimeoutError:
            self.events.event(
                scope,
                "conflict",
                409,
                logging.INFO,
                "porch: a duplicate waited %.1f s for its owner; 409",
                wait,
            )
            await problem(
                409,
                "a request with this Idempotency-Key is still being processed; retry later",
                headers=self._retry_after,
            )(scope, receive, send)
            return
        except SaturatedError as exc:
            self.events.event(
                scope,
                "saturated",
                503,
                logging.WARNING,
                "porch: idempotency saturated (%s); answering 503",
                exc,
            )
            await problem(
                503, f"idempotency saturated: {exc}", cause="saturated", headers=self._retry_after
            )(scope, receive, send)
            return
        except (StoreError, PoolClosedError) as exc:
            await self._store_failed(scope, receive, send, exc)
            return

        outcomes = self.events.outcomes
        if isinstance(outcome, StoredResponse):
            if outcome.parts is not None:
                await self._replay_parts(scope, receive, send, key, outcome)
                return
            if self.integrity is not None and not self.integrity.verify(key, outcome):
                await self._forged(scope, receive, send)
                return
            if outcomes is not None:
                outcomes["replayed"].inc()
            await _replay(outcome)(scope, receive, send)
        elif isinstance(outcome, Mismatch):
            self.events.event(
                scope,
                "mismatch",
                422,
                logging.INFO,
                "porch: an Idempotency-Key was reused for a different request (422)",
            )
            await problem(422, "this Idempotency-Key was used for a different request")(
                scope, receive, send
            )
        elif isinstance(outcome, QuotaFull):
            await self._over_quota(scope, receive, send, reservation, outcome)
        elif outcome is OWNER:
            if outcomes is not None:
                outcomes["executed"].inc()
            capture = Capture(send, self, policy, key, acquire.token, reservation, digest, shard)
            await self._run_owner(scope, receive, capture, body)

    async def _replay_parts(
        self, scope: Scope, receive: Receive, send: Send, key: str, stored: StoredResponse
    ) -> None:
        """Replay a body kept in parts, one part in memory at a time.

        With an integrity key, the whole body is read and its MAC checked before the first
        byte leaves (a forged or damaged record is refused whole, 503), and checked again
        as it is sent: a body that changed in between loses its last part. A part found
        missing before the first byte is a 503 (its record expired meanwhile: a retry runs
        the handler); after it, the response is cut short of its Content-Length and the
        connection closed, which every client reports as an incomplete response.
        """
        parts, ref = self.parts, stored.parts
        if parts is None or ref is None:
            await self._unreadable(scope, receive, send, "this store keeps no bodies in parts")
            return
        check = None
        if self.integrity is not None:
            check = self.integrity.check(key, stored)
            if check is None:  # no MAC at all: written without the key
                await self._forged(scope, receive, send)
                return
            try:
                for index in range(ref.count):
                    found = await parts.read(key, ref, index)
                    if found is None:
                        await self._unreadable(scope, receive, send, f"part {index} is gone")
                        return
                    check.update(found)
            except StoreError as exc:
                await self._store_failed(scope, receive, send, exc)
                return
            if not check.verified():
                await self._forged(scope, receive, send)
                return
            check = self.integrity.check(key, stored)  # again, as the parts leave
        try:
            first = await parts.read(key, ref, 0)
        except StoreError as exc:
            await self._store_failed(scope, receive, send, exc)
            return
        if first is None:
            await self._unreadable(scope, receive, send, "part 0 is gone")
            return
        outcomes = self.events.outcomes
        if outcomes is not None:
            outcomes["replayed"].inc()
        headers = [pair for pair in stored.headers if pair[0] in REPLAYED_HEADERS]
        headers.append((b"idempotent-replayed", b"true"))
        headers.append((b"content-length", str(ref.length).encode("ascii")))
        await send({"type": "http.response.start", "status": stored.status, "headers": headers})
        piece: bytes | None = first
        sent = 0
        for index in range(ref.count):
            if index:
                try:
                    piece = await parts.read(key, ref, index)
                except StoreError as exc:
                    self._cut_short(scope, f"reading part {index} failed: {exc}")
                    return
            if piece is None:
                self._cut_short(scope, f"part {index} is gone")
                return
            sent += len(piece)
            last = index == ref.count - 1
            if check is not None:
                check.update(piece)
                if last and not check.verified():
                    self._cut_short(scope, "the body changed since it was checked")
                    return
            if sent > ref.length or (last and sent != ref.length):
                self._cut_short(scope, f"its parts hold {sent} bytes, not {ref.length}")
                return
            await send({"type": "http.response.body", "body": piece, "more_body": not last})

    async def _unreadable(self, scope: Scope, receive: Receive, send: Send, why: str) -> None:
        """A stored body in parts that cannot be read before its first byte left (its record
        expired meanwhile, or the store lost it): 503, and a retry finds the key anew."""
        self.events.event(
            scope,
            "store",
            503,
            logging.ERROR,
            "porch: a stored response could not be replayed (%s); answering 503",
            why,
        )
        await problem(
            503,
            "the stored response for this Idempotency-Key could not be read; retry",
            cause="store",
            headers=self._retry_after,
        )(scope, receive, send)

    def _cut_short(self, scope: Scope, why: str) -> None:
        """A replay in parts that cannot go on after its head left: it ends short of its
        Content-Length (the server closes the connection; the client sees it incomplete)."""
        self.events.event(
            scope,
            "store",
            503,
            logging.ERROR,
            "porch: a replay was cut short (%s); the client got an incomplete response",
            why,
        )

    async def _forged(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A stored response whose MAC does not verify: written by someone without the key
        (or before it was set), so it is not replayed."""
        self.events.event(
            scope,
            "integrity",
            503,
            logging.ERROR,
            "porch: a stored response failed its integrity check (written without"
            " integrity_key, or tampered with); not replayed (503)",
        )
        await problem(
            503,
            "the stored response for this Idempotency-Key failed its integrity check",
            cause="integrity",
            headers=self._retry_after,
        )(scope, receive, send)

    async def _over_quota(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        reservation: Reservation,
        full: QuotaFull,
    ) -> None:
        """Refuse a request whose response could not be stored: before its handler runs,
        so no retry ever runs it twice because of a quota. The caller's own quotas (its
        scope's, its client's) are its to wait out: 429; the store's is not: 503."""
        status = 503 if full.bucket == "total" else 429
        self.events.over_quota(reservation.scope, reservation.client, full.bucket, status)
        whose = {
            "scope": "this caller's stored responses have",
            "client": "this client's stored responses have",
            "total": "the store's stored responses have",
        }[full.bucket]
        await problem(
            status,
            f"{whose} reached their quota: a response to this request could not be stored,"
            " so it was not run; retry once earlier responses expire",
            cause="quota",
            headers=self._retry_after,
        )(scope, receive, send)

    async def _run_owner(
        self, scope: Scope, receive: Receive, capture: Capture, body: bytes
    ) -> None:
        try:
            await self.app(scope, replaying(body, receive), capture)
        finally:
            # Always report, also when the handler raised or was cancelled: a
            # missing report would leave the duplicates parked until their deadline.
            if not capture.reported:
                capture.abandon()

    def report_owner(
        self,
        key: str,
        token: int,
        reservation: Reservation,
        response: StoredResponse | None,
        shard: int,
        ttl: float | None = None,
    ) -> asyncio.Future[Report]:
        """Send the owner's report to ``shard``, the one its Acquire went to; a response is
        kept ``ttl`` seconds (default: the middleware's)."""
        done: asyncio.Future[Report] = asyncio.get_running_loop().create_future()
        kept = self.ttl if ttl is None else ttl
        call = Complete.of(
            done, key, token, response, kept, reservation.scope, self.quota, reservation.client
        )
        try:
            self.pool.submit(key, call, must_deliver=True, shard=shard)
        except PoolClosedError as exc:
            done.set_exception(exc)
        if response is None:
            # Reports of unstored responses are not awaited; never leave an error unretrieved.
            done.add_done_callback(_retrieve)
        return done


class _BodyTooLarge(Exception):
    """Raised when a keyed request body exceeds ``max_body``."""


async def _read_body(receive: Receive, max_body: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > max_body:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _replay(stored: StoredResponse) -> BytesResponse:
    # Only the allow-list, as read: porch stores nothing else, so anything else in a
    # stored head (Set-Cookie, say) was written by someone else, and is never sent.
    headers = [pair for pair in stored.headers if pair[0] in REPLAYED_HEADERS]
    headers.append((b"idempotent-replayed", b"true"))
    return BytesResponse(stored.status, stored.body, headers)
