"""The rate-limit middleware: durable, exact fixed windows through the key pool.

Pure ASGI. A selected request becomes one ``Hit`` sent to the shard owning its
client key; the shard's store transaction decides (all limits of the rule, all
or nothing) and only then does the request run or get refused. The middleware
never reads or writes a counter itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence

from .._asgi import adding_headers, pass_through, route_path, websocket_denial
from .._eventlog import EventLog
from .._paths import normalize_method
from .._responses import problem
from .._types import ASGIApp, Message, Receive, Scope, Send
from ..clock import Clock, SystemClock
from ..errors import (
    ConfigurationError,
    ForwardingHeaderError,
    PoolClosedError,
    PorchError,
    SaturatedError,
    StoreError,
)
from ..identity import ClientIdentity, KeyFunc
from ..pool._pool import KeyPool
from ..pool._shard import Call, Shard
from ..store.base import Hit, Settle, StoreOp, Vacate
from ._costs import RESERVATIONS, Reservation
from ._decisions import CompiledRule as _CompiledRule
from ._decisions import (
    HeaderStyle,
    PolicyState,
    Refusal,
    check_header_style,
    decide,
    remembered_hit,
)
from ._policies import Resolved, resolve
from ._refusals import RefusalMemory
from ._rules import Rule
from ._slices import Slice, SliceBook

__all__ = ["Exemption", "PolicyState", "RateLimitMiddleware", "Refusal", "RefusalFactory"]

logger = logging.getLogger("porch.ratelimit")


RefusalFactory = Callable[[Scope, Refusal], ASGIApp]
#: A predicate on the request's scope (sync, or async): True exempts the request.
Exemption = Callable[[Scope], bool | Awaitable[bool]]


def default_refusal(scope: Scope, refusal: Refusal) -> ASGIApp:
    """A 429 ``application/problem+json`` body naming the level that refused and listing the
    violated policies, each with its level (a concurrency cap's with ``"unit":
    "concurrent-requests"``)."""
    return problem(
        429,
        f"rate limit exceeded; retry in {refusal.retry_after} s",
        level=refusal.level,
        violated=[
            {
                "policy": p.name,
                "level": p.level,
                "limit": p.limit,
                "window": p.window,
                "reset_after": p.reset_after,
            }
            if p.unit == "requests"
            else {
                "policy": p.name,
                "level": p.level,
                "limit": p.limit,
                "unit": p.unit,
                "remaining": p.remaining,
                "reset_after": p.reset_after,
            }
            for p in refusal.violated
        ],
    )


def _bad_forwarding(exc: ForwardingHeaderError) -> ASGIApp:
    """400 for a request whose client cannot be identified: never a key it could choose."""
    return problem(400, f"the client cannot be identified: {exc}", cause="forwarding")


class _HitCall(Call):
    __slots__ = ("hit",)

    def __init__(self, future: asyncio.Future[Hit], hit: Hit) -> None:
        self.future = future  # Call.__init__, inlined: this runs once per limited request
        self.hit = hit

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        ops.append(self.hit)

    def finish(self, shard: Shard) -> None:
        future = self.future
        if not future.done():
            future.set_result(self.hit)
        elif self.hit.token and future.cancelled():
            # Its request was cancelled while the hit was in the store (a client gone, a
            # server stopping): the slots it took are nobody's, and only this frees them.
            _vacate_for_nobody(shard, Vacate.of(self.hit))


def _vacate_for_nobody(shard: Shard, vacate: Vacate) -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.add_done_callback(_retrieve)  # a failure is the store's to log and end
    with contextlib.suppress(PoolClosedError):  # the store is closing: its slots end with it
        shard.mailbox.send_nowait(_VacateCall(future, vacate), force=True)


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


class _SettleCall(Call):
    __slots__ = ("settle",)

    def __init__(self, future: asyncio.Future[None], settle: Settle) -> None:
        self.future = future
        self.settle = settle

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        ops.append(self.settle)

    def finish(self, shard: Shard) -> None:
        if not self.future.done():
            self.future.set_result(None)


class _VacateCall(Call):
    __slots__ = ("vacate",)

    def __init__(self, future: asyncio.Future[None], vacate: Vacate) -> None:
        self.future = future
        self.vacate = vacate

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        ops.append(self.vacate)

    def finish(self, shard: Shard) -> None:
        if not self.future.done():
            self.future.set_result(None)


class RateLimitMiddleware:
    """Limit requests per client with durable, exact fixed-window counters.

    ``rules`` are tried in order and the first that selects a request applies;
    requests no rule selects, and ``exempt`` ones, pass untouched and consume
    nothing. ``exempt`` holds paths (exact, or a prefix when the entry ends in
    ``/``) and predicates: a callable given the request's scope, returning (or, if
    async, awaiting to) True to exempt it — staff users (``scope["user"]`` set by
    the app's authentication middleware), an internal network. A predicate runs
    only for a request a rule selects, before its key is found. ``key`` finds the
    client (default: the connection's peer host; see :class:`ClientIdentity`).
    ``dry_run`` counts and reports but never refuses. A store failure answers 503
    unless ``fail_open`` lets the request through uncounted; saturation always
    answers 503. ``enabled=False`` passes every request through untouched and
    never opens the store (an off switch for tests). A refusal is remembered
    and answered from memory (no mailbox slot) until the rule's first window
    ends, at most ``refusal_memory`` seconds (0: off), for at most
    ``refusal_memory_entries`` clients; ``clock`` defaults to the store's.
    ``headers`` picks the rate-limit fields each limited response carries: the IETF
    draft's ``RateLimit-Policy`` and ``RateLimit`` (``"ietf"``),
    ``X-RateLimit-Limit/-Remaining/-Reset`` (``"x-ratelimit"``), ``"both"`` (the
    default) or ``"none"``; a refusal carries ``Retry-After`` whatever the choice.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        pool: KeyPool,
        rules: Sequence[Rule] | Rule,
        key: KeyFunc | None = None,
        exempt: Iterable[str | Exemption] = ("/health",),
        dry_run: bool = False,
        fail_open: bool = False,
        on_refused: RefusalFactory = default_refusal,
        retry_after_saturated: int = 1,
        refusal_memory: float = 1.0,
        refusal_memory_entries: int = 10_000,
        clock: Clock | None = None,
        enabled: bool = True,
        headers: HeaderStyle = "both",
    ) -> None:
        rules = (rules,) if isinstance(rules, Rule) else tuple(rules)
        if not rules:
            raise ConfigurationError("RateLimitMiddleware needs at least one Rule")
        if not isinstance(pool, KeyPool):
            raise ConfigurationError("pool must be a porch KeyPool")
        if retry_after_saturated < 1:
            raise ConfigurationError(
                f"retry_after_saturated must be >= 1 second, got {retry_after_saturated}"
            )
        if not (isinstance(refusal_memory, int | float) and 0 <= refusal_memory < math.inf):
            raise ConfigurationError(f"refusal_memory must be >= 0 seconds, got {refusal_memory}")
        if refusal_memory_entries < 1:
            raise ConfigurationError(
                f"refusal_memory_entries must be >= 1, got {refusal_memory_entries}"
            )
        check_header_style(headers)
        names = [r.name for r in rules if not r.shared]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"rule names must be unique, got {names}")
        offered = pool.store.capabilities.algorithms
        for r in rules:
            if r.concurrency and not pool.store.capabilities.slots:
                raise ConfigurationError(
                    f"rule {r.name!r}: concurrency limit {r.concurrency[0].name!r} needs a store"
                    f" that takes concurrency slots; {type(pool.store).__name__} does not"
                )
            for limit in r.every_limit():
                if limit.algorithm not in offered:
                    raise ConfigurationError(
                        f"rule {r.name!r}: limit {limit.name!r} uses {limit.algorithm!r}, which"
                        f" {type(pool.store).__name__} does not decide"
                        f" (it offers {', '.join(sorted(offered))})"
                    )
        for r in rules:
            # Now, when the app is built, not at the first request: a name another
            # limiter on this pool uses for other requests would share its counters.
            pool.namespaces.claim(r.name, r.signature(), r.describe())
        self.app = app
        self.pool = pool
        self.enabled = enabled
        self._rules = tuple(_CompiledRule(r, headers) for r in rules)
        # The common configuration: a first rule over the whole app and every method. It
        # selects every HTTP request that is not exempt, so such a request is neither
        # normalized nor matched (see _select: matches() is True for any method and path).
        first = rules[0]
        self._everything = (
            self._rules[0]
            if first.methods is None and first.pattern is None and first.path == "/"
            else None
        )
        self._websocket = any(r.websocket for r in rules)
        self._key: KeyFunc = key if key is not None else ClientIdentity()
        if isinstance(exempt, str) or callable(exempt):
            exempt = (exempt,)
        paths: list[str] = []
        predicates: list[Exemption] = []
        for entry in exempt:
            if callable(entry):
                predicates.append(entry)
            elif not isinstance(entry, str) or not entry.startswith("/"):
                raise ConfigurationError(
                    f"exempt paths must start with '/' (or be predicates), got {entry!r}"
                )
            else:
                paths.append(entry)
        self._exact = frozenset(p for p in paths if not p.endswith("/") or p == "/")
        self._prefixes = tuple(p for p in paths if p.endswith("/") and p != "/")
        self._predicates = tuple(predicates)
        self.dry_run = dry_run
        self.fail_open = fail_open
        self._on_refused = on_refused
        self._saturated_retry = str(retry_after_saturated).encode("ascii")
        # Refusals and 503s are logged, throttled per client and rule (see EventLog).
        self._log = EventLog(logger)
        metrics = pool.metrics
        self._causes = metrics.causes if metrics is not None else None
        if metrics is not None:
            for compiled in self._rules:
                compiled.counters = metrics.ratelimit(compiled.rule.name)
                for variant in compiled.variants.values():
                    variant.counters = compiled.counters
        if clock is None:
            # The store's clock when it decides on one here, so a ManualClock moves both.
            store_clock = pool.store.capabilities.clock
            clock = store_clock if store_clock is not None else SystemClock()
        self._clock: Clock = clock
        self._memory = (
            RefusalMemory(clock, seconds=refusal_memory, entries=refusal_memory_entries)
            if refusal_memory > 0 and not dry_run
            else None
        )
        # Sliced limits' units leased to this host; handed back as the pool closes.
        self._slices: SliceBook | None = None
        if any(compiled.sliced for compiled in self._rules):
            self._slices = SliceBook(clock)
            pool.before_close(self._return_slices)

    def _select(self, scope: Scope, path: str) -> _CompiledRule | None:
        """The first rule selecting a request at ``path`` (the route path; not exempt:
        __call__ checked), or None."""
        if scope["type"] == "websocket":
            # A handshake is a GET, selected only by rules that opted in.
            for compiled in self._rules:
                if compiled.rule.websocket and compiled.rule.matches("GET", path):
                    return compiled
            return None
        method = normalize_method(scope["method"])
        for compiled in self._rules:
            if compiled.rule.matches(method, path):
                return compiled
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled:
            await self.app(scope, receive, send)
            return
        kind = scope["type"]
        if kind != "http" and not (kind == "websocket" and self._websocket):
            await pass_through(self.app, self.pool, scope, receive, send)
            return
        # Exempt paths first: once per request, so route_path inline when nothing is mounted.
        path: str = scope["path"]
        if scope.get("root_path"):
            path = route_path(scope)
        if path in self._exact or (self._prefixes and path.startswith(self._prefixes)):
            await self.app(scope, receive, send)
            return
        compiled = self._everything if kind == "http" else None
        if compiled is None:
            compiled = self._select(scope, path)
            if compiled is None:
                await self.app(scope, receive, send)
                return
        if self._predicates and await self._exempted(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            # Refused before accept: porch's HTTP answers become a denial response.
            send = websocket_denial(scope, send)

        try:
            found = self._key(scope)
            # An async key function (an API key looked up in a database) is awaited.
            client = found if isinstance(found, str) else await found
        except ForwardingHeaderError as exc:
            await self._unidentified(exc, compiled, scope, receive, send)
            return
        if not compiled.plain:
            # Costs, settles, levels or plans: the general path (this one is today's shape).
            await self._policy(compiled, client, scope, receive, send)
            return
        prefixes = compiled.prefixes
        keys = [prefixes[0] + client] if len(prefixes) == 1 else [p + client for p in prefixes]
        memory = self._memory
        hit: Hit | PorchError | None = None
        if memory is None or not memory.entries:
            # Nothing remembered (or no memory): straight to the store. This is the common
            # path, so it asks the store itself instead of through _ask_store's coroutine.
            pool = self.pool
            hit = Hit(
                keys, compiled.amounts, compiled.windows, compiled.algorithms, compiled.bursts
            )
            # Nothing else in flight: committed right here, no hop at all (apply_now).
            if not pool.apply_now(client, hit):
                try:
                    future = asyncio.get_running_loop().create_future()
                    try:
                        pool.submit(client, _HitCall(future, hit))
                    except PoolClosedError:
                        if pool.started:
                            raise
                        await pool.start()  # the first request on this loop starts the actors
                        pool.submit(client, _HitCall(future, hit))
                    await future
                except SaturatedError as exc:
                    self._unavailable("saturated", exc, client, compiled, exc.shard)
                    hit = exc
                except (StoreError, PoolClosedError) as exc:
                    self._unavailable("store", exc, client, compiled, None)
                    hit = exc
            if memory is not None and isinstance(hit, Hit) and not hit.allowed:
                memory.remember(keys[0], hit)
        else:
            while True:
                recalled = memory.recall(keys[0])
                if not isinstance(recalled, asyncio.Future):
                    break
                # Another request is asking the store about this client right now.
                await asyncio.shield(recalled)
            if recalled is not None:
                # Known to be over its limit: refused from memory, no mailbox slot taken.
                clock = self._clock
                hit = remembered_hit(recalled, keys, compiled, clock.monotonic(), clock.wall())
            else:
                try:
                    hit = await self._ask_store(keys, compiled, client)
                finally:
                    # Before anything else runs: whoever waits for this answer goes on.
                    if isinstance(hit, Hit) and not hit.allowed:
                        memory.remember(keys[0], hit)
                    else:
                        memory.forget_expired(keys[0])
        if not isinstance(hit, Hit):
            await self._failed(hit, scope, receive, send)
            return
        headers, refusal = decide(compiled, hit, client)
        counters = compiled.counters
        if refusal is not None:
            if counters is not None:
                counters[1].inc()
            self._log_refusal(compiled, refusal)
            if not self.dry_run:
                response = self._on_refused(scope, refusal)
                await response(scope, receive, adding_headers(send, headers))
                return
        elif counters is not None:
            counters[0].inc()
        await self.app(scope, receive, adding_headers(send, headers) if headers else send)

    async def _unidentified(
        self,
        exc: ForwardingHeaderError,
        compiled: _CompiledRule,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """400 for a request whose client (or a level's key) cannot be identified."""
        # Throttled like every refusal: a flood of forged headers is one line a second.
        self._log.event(
            logging.WARNING,
            ("forwarding",),
            asyncio.get_running_loop().time(),
            1.0,
            "porch: refused a request whose client cannot be identified: %s",
            exc,
            rule=compiled.rule.name,
            outcome="unidentified",
            status=400,
        )
        await _bad_forwarding(exc)(scope, receive, send)

    async def _exempted(self, scope: Scope) -> bool:
        """Whether an exemption predicate exempts the request (the first True wins)."""
        for predicate in self._predicates:
            answer = predicate(scope)
            if inspect.isawaitable(answer):
                answer = await answer
            if answer:
                return True
        return False

    async def _policy(
        self, compiled: _CompiledRule, client: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A request under a rule with a cost, a settle, levels or plans: its plan's limits,
        each under its level's key, charged its cost; settled after the response."""
        try:
            resolved = await resolve(
                compiled, client, scope, receive, self._clock.monotonic, self._log
            )
        except ForwardingHeaderError as exc:  # a level's key function could not say
            await self._unidentified(exc, compiled, scope, receive, send)
            return
        if not isinstance(resolved, Resolved):
            if resolved is not None:  # the cost cannot be read: 400, 413
                await resolved(scope, receive, send)
            return  # (None: the client left while its body was read)
        receive = resolved.receive
        variant = resolved.compiled
        if variant is None:  # no level of the rule applies to this request
            await self.app(scope, receive, send)
            return
        keys, cost, memo = resolved.keys, resolved.cost, resolved.memo
        # Concurrency caps: a slot of each, the client's, taken with the hit.
        slots = [p + client for p in variant.slot_prefixes] if variant.slot_caps else None
        hit: Hit | PorchError
        if variant.sliced:
            variant, hit = await self._sliced(keys, variant, client, cost, memo)
        else:
            hit = await self._decision(keys, variant, client, cost, slots, memo)
        if not isinstance(hit, Hit):
            await self._failed(hit, scope, receive, send)
            return
        headers, refusal = decide(variant, hit, client)
        counters = variant.counters
        if refusal is not None:
            if counters is not None:
                counters[1].inc()
            self._log_refusal(variant, refusal)
            if not self.dry_run:
                response = self._on_refused(scope, refusal)
                await response(scope, receive, adding_headers(send, headers))
                return
        elif counters is not None:
            counters[0].inc()
        send = adding_headers(send, headers) if headers else send
        settling = hit.allowed and variant.rule.settle
        if not settling and not hit.token:
            await self.app(scope, receive, send)
            return
        reservation: Reservation | None = None
        if settling:
            # A reservation: the handler may report what the request cost (settle()).
            reservation = Reservation(variant.rule.name)
            held: list[Reservation] | None = scope.get(RESERVATIONS)
            if held is None:
                scope[RESERVATIONS] = [reservation]
            else:
                held.append(reservation)
        vacate = Vacate.of(hit) if hit.token else None  # (no caps, or a dry run's refusal)
        settled = False

        def pending() -> bool:
            return vacate is not None or (
                not settled and reservation is not None and reservation.actual is not None
            )

        async def finish() -> None:
            # What the request held, freed; what its handler reported, settled.
            nonlocal vacate, settled
            if vacate is not None:
                freeing, vacate = vacate, None
                await self._vacate(client, freeing, variant)
            if not settled and reservation is not None and reservation.actual is not None:
                settled = True
                if reservation.actual != hit.cost:
                    await self._settle(hit, reservation.actual, client, variant, memo)

        async def last(message: Message) -> None:
            await finish()
            await send(message)

        def sending(message: Message) -> Awaitable[None]:
            # Before the response's last body chunk leaves: its slots are free and what it
            # reported is settled, so a client that sends its next request once it has
            # read this response finds both done. Not a coroutine function: every other
            # message is send's own awaitable (no coroutine of its own, as adding_headers).
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return last(message)
            return send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # The app returned having reported after its last chunk, or raised after it
            # reported, or was cancelled (its client gone, the server stopping): shielded,
            # so the slots are freed and the report settled all the same. Never reported
            # (it raised first, its client left): the estimate charged with the hit stands.
            if pending():
                await asyncio.shield(asyncio.ensure_future(finish()))

    async def _decision(
        self,
        keys: list[str],
        variant: _CompiledRule,
        client: str,
        cost: int,
        slots: list[str] | None,
        memo: str,
    ) -> Hit | PorchError:
        """The store's decision on a hit of ``variant`` (or a refusal remembered for
        ``memo``), or the error that kept it from deciding."""
        memory = self._memory if keys else None  # (a rule of caps only: nothing to recall)
        if memory is None:
            return await self._ask_store(keys, variant, client, cost, slots)
        while True:
            recalled = memory.recall(memo)
            if not isinstance(recalled, asyncio.Future):
                break
            await asyncio.shield(recalled)  # another request asks the store right now
        if recalled is not None and recalled.cost <= cost:
            # A rate limit refused at a cost no higher than this one: this one would
            # be too (no slot is asked for).
            clock = self._clock
            return remembered_hit(recalled, keys, variant, clock.monotonic(), clock.wall())
        refunds = memory.refunds
        hit: Hit | PorchError | None = None
        try:
            hit = answer = await self._ask_store(keys, variant, client, cost, slots)
        finally:
            # Only a rate limit's refusal (a slot may free at any moment), and not
            # one decided while a refund was applied (it may predate it).
            if (
                isinstance(hit, Hit)
                and not hit.allowed
                and not all(hit.fits)
                and memory.refunds == refunds
            ):
                memory.remember(memo, hit)
            else:
                memory.forget_expired(memo)
        return answer

    async def _sliced(
        self, keys: list[str], variant: _CompiledRule, client: str, cost: int, memo: str
    ) -> tuple[_CompiledRule, Hit | PorchError]:
        """A hit of a rule with sliced limits: each taken from this host's slice first (a
        lease when it runs short), then the rest of the rule asked of the store; all or
        nothing (what was taken is given back if anything refuses). Returns what the
        decision is told as: the rule, or, refused by a slice, its sliced limits so far."""
        book = self._slices
        if book is None:  # pragma: no cover - built with any sliced rule
            raise PorchError("no slices")
        limits = variant.limits
        parts: dict[int, tuple[Slice, bool]] = {}
        taken: list[tuple[int, Slice, float]] = []

        def lease(key: str, amount: int, window: float, units: int) -> Awaitable[Hit | PorchError]:
            return self._ask(Hit([key], [amount], [window], cost=units), variant, client)

        def give_back() -> None:
            for j, found, stamp in taken:
                book.give(keys[j], found, stamp, cost)

        for j in variant.sliced:
            limit = limits[j]
            size = limit.slice or 1
            outcome = await book.take(keys[j], limit.amount, limit.window, size, cost, lease)
            if not isinstance(outcome, tuple):
                give_back()
                return variant, outcome
            parts[j] = outcome
            if not outcome[1]:
                give_back()
                kept = tuple(i in parts for i in range(len(limits)))
                told = variant.subset(kept) or variant
                return told, self._slice_hit(told, keys, kept, cost, parts, None)
            taken.append((j, outcome[0], outcome[0].stamp))
        direct: Hit | None = None
        kept = tuple(limit.slice is None for limit in limits)
        rest = variant.subset(kept) if any(kept) else None
        if rest is not None:
            answer = await self._decision(
                [k for k, keep in zip(keys, kept, strict=True) if keep],
                rest,
                client,
                cost,
                None,
                memo,
            )
            if not isinstance(answer, Hit):
                give_back()
                return variant, answer
            if not answer.allowed:
                give_back()
            direct = answer
        every = (True,) * len(limits)
        return variant, self._slice_hit(variant, keys, every, cost, parts, direct)

    def _slice_hit(
        self,
        told: _CompiledRule,
        keys: list[str],
        kept: tuple[bool, ...],
        cost: int,
        parts: dict[int, tuple[Slice, bool]],
        direct: Hit | None,
    ) -> Hit:
        """The decision on ``told``'s limits (``kept`` of the rule's), from the slices'
        ``parts`` and the store's ``direct`` decision on the rest."""
        now = self._clock.monotonic()
        hit = told.hit([k for k, keep in zip(keys, kept, strict=True) if keep], cost)
        fits: list[bool] = []
        remaining: list[int] = []
        until: list[float] = []
        full: list[float] = []
        retry: list[float] = []
        stamps: list[float] = []
        d = 0  # the next of the direct decision's limits
        for j, keep in enumerate(kept):
            if not keep:
                continue
            part = parts.get(j)
            if part is not None:
                found, took = part
                left = max(0.0, found.until - now)
                fits.append(took)
                remaining.append(found.remaining())
                until.append(left)
                full.append(left)
                retry.append(0.0 if took else left)
                stamps.append(found.stamp)
            elif direct is not None:
                fits.append(direct.fits[d])
                remaining.append(direct.remaining[d])
                until.append(direct.next[d])
                full.append(direct.full[d])
                retry.append(direct.retry[d])
                stamps.append(direct.stamp[d])
                d += 1
        hit.fits = fits
        hit.allowed = all(fits) and (direct is None or direct.allowed)
        hit.remaining = remaining
        hit.next = until
        hit.full = full
        hit.retry = retry
        hit.stamp = stamps
        hit.wall = direct.wall if direct is not None else self._clock.wall()
        return hit

    async def _return_slices(self) -> None:
        """Hand back every unspent unit of this host's slices (the pool is closing)."""
        book = self._slices
        if book is None:  # pragma: no cover - registered only with a book
            return
        pool = self.pool
        loop = asyncio.get_running_loop()
        waiting: list[asyncio.Future[None]] = []
        for refund in book.drain():
            key = refund.keys[0]
            if not pool.apply_now(key, refund):
                future: asyncio.Future[None] = loop.create_future()
                pool.submit(key, _SettleCall(future, refund), must_deliver=True)
                waiting.append(future)
        if waiting:
            await asyncio.gather(*waiting)

    async def _settle(
        self, hit: Hit, actual: int, client: str, compiled: _CompiledRule, memo: str
    ) -> None:
        """Charge or refund the difference between ``actual`` and the hit's estimate."""
        op = Settle.of(hit, actual)
        pool = self.pool
        try:
            if not pool.apply_now(client, op):
                future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                # Delivered past a full mailbox: it is bounded by the hits already admitted,
                # and a debt dropped would be units served for free.
                pool.submit(client, _SettleCall(future, op), must_deliver=True)
                # Not shielded: cancelled, the settle is applied all the same (it is queued,
                # and its call answers only a future not done).
                await future
            memory = self._memory
            if memory is not None and actual < hit.cost:
                # A refund, committed: a refusal remembered here may not hold any more.
                memory.forget(memo)
        except (StoreError, PoolClosedError) as exc:
            self._log.event(
                logging.ERROR,
                ("settle",),
                asyncio.get_running_loop().time(),
                1.0,
                "porch: a settle of %d units (estimate %d) on rule %r was not applied (%s);"
                " the estimate stands",
                actual,
                hit.cost,
                compiled.rule.name,
                exc,
                client=client,
                rule=compiled.rule.name,
                outcome="settle lost",
            )

    async def _vacate(self, client: str, vacate: Vacate, compiled: _CompiledRule) -> None:
        """Free a request's slots; never refused (a full mailbox takes it all the same)."""
        pool = self.pool
        if pool.apply_now(client, vacate):
            return
        try:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            pool.submit(client, _VacateCall(future, vacate), must_deliver=True)
            await future
        except (StoreError, PoolClosedError) as exc:
            # The store keeps what it can: SQLite writes the vacate with its next
            # transaction, a lease store stops renewing the slots (they lapse within its
            # lease), and a closing store frees every slot of this process.
            self._log.event(
                logging.ERROR,
                ("vacate",),
                asyncio.get_running_loop().time(),
                1.0,
                "porch: freeing a request's concurrency slots failed (%s)",
                exc,
                client=client,
                rule=compiled.rule.name,
                outcome="unavailable",
                cause="store",
            )

    async def _ask_store(
        self,
        keys: list[str],
        compiled: _CompiledRule,
        client: str,
        cost: int = 1,
        slots: list[str] | None = None,
    ) -> Hit | PorchError:
        """The store's decision, or the error that kept it from deciding (logged)."""
        return await self._ask(compiled.hit(keys, cost, slots), compiled, client)

    async def _ask(self, hit: Hit, compiled: _CompiledRule, client: str) -> Hit | PorchError:
        """The store's decision on ``hit``, or the error that kept it from deciding (logged)."""
        pool = self.pool
        if pool.apply_now(client, hit):
            return hit
        try:
            if not pool.started:
                await pool.start()
            future: asyncio.Future[Hit] = asyncio.get_running_loop().create_future()
            pool.submit(client, _HitCall(future, hit))
            await future
        except SaturatedError as exc:
            self._unavailable("saturated", exc, client, compiled, exc.shard)
            return exc
        except (StoreError, PoolClosedError) as exc:
            self._unavailable("store", exc, client, compiled, None)
            return exc
        return hit

    async def _failed(
        self, exc: PorchError | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Answer a request the store could not decide: 503, or through if ``fail_open``."""
        if isinstance(exc, SaturatedError):
            await problem(
                503,
                f"rate limiter saturated: {exc}",
                cause="saturated",
                headers=[(b"retry-after", self._saturated_retry)],
            )(scope, receive, send)
        elif self.fail_open:
            await self.app(scope, receive, send)
        else:
            await problem(
                503,
                "rate limit store unavailable",
                cause="store",
                headers=[(b"retry-after", self._saturated_retry)],
            )(scope, receive, send)

    def _log_refusal(self, compiled: _CompiledRule, refusal: Refusal) -> None:
        rule = compiled.rule.name
        # Once per client and rule until its window ends: a flood of 429s is one line.
        self._log.event(
            logging.WARNING,
            (refusal.key, rule),
            asyncio.get_running_loop().time(),
            refusal.retry_after,
            "porch: %s client %r on rule %r (429, retry in %d s)",
            "counted (dry run)" if self.dry_run else "refused",
            refusal.key,
            rule,
            refusal.retry_after,
            client=refusal.key,
            rule=rule,
            outcome="dry_run" if self.dry_run else "refused",
            status=429,
            policies=[p.name for p in refusal.violated],
            refused_by=refusal.level,
            retry_after=refusal.retry_after,
        )

    def _unavailable(
        self,
        cause: str,
        exc: Exception,
        client: str,
        compiled: _CompiledRule,
        shard: int | None,
    ) -> None:
        if self._causes is not None and not (cause == "store" and self.fail_open):
            self._causes[cause].inc()
        passed = cause == "store" and self.fail_open
        # At most once a second per shard (saturation) or per cause (store).
        self._log.event(
            logging.WARNING if cause == "saturated" else logging.ERROR,
            (cause, shard),
            asyncio.get_running_loop().time(),
            1.0,
            "porch: %s (%s); %s",
            "rate limiter saturated" if cause == "saturated" else "rate limit store failed",
            exc,
            "fail_open lets it through uncounted" if passed else "answering 503",
            client=client,
            rule=compiled.rule.name,
            outcome="passed" if passed else "unavailable",
            cause=cause,
            status=None if passed else 503,
            shard=shard,
        )
