"""Idempotent functions: a job or a webhook consumer runs once per key, as a request does.

:func:`idempotent_function` wraps an async or a sync function. A call names its key
(from the arguments, or given with :meth:`IdempotentFunction.with_key`) and goes
through the very path a keyed HTTP request takes — the key pool's
:class:`~porch.idempotency._ownership.Acquire`, the store's fenced claim, then a
:class:`~porch.idempotency._ownership.Complete` — so it has the same guarantees: one
execution per key across every process and host sharing the store, duplicates wait
for the running call's result (at most ``wait_timeout``), a call that raises stores
nothing (the next duplicate runs it), and a crash never wedges the key (the claim
dies with its holder, as the store promises). The result is kept for ``ttl``
seconds, encoded by a codec (JSON by default) as a stored response's body. As a keyed
request's, a call's claim reserves ``max_stored`` bytes of the function's quota (a
full quota refuses the call before it runs), and with an ``integrity_key`` its
result is signed when stored and checked before a stored result is returned. With the
pool's :class:`~porch.PorchMetrics`, each call's outcome is counted per function
(``porch_idempotent_function_calls``), and so are the calls that waited for another
(``porch_idempotent_function_waits``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import inspect
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast

from ..errors import (
    ConfigurationError,
    IntegrityError,
    KeyInProgressError,
    KeyReusedError,
    PoolClosedError,
    QuotaFullError,
    SaturatedError,
    StoreError,
)
from ..pool._pool import KeyPool
from ..store.base import Quota, StoredResponse, stored_size
from ._integrity import IntegrityKeys
from ._ownership import (
    OWNER,
    Acquire,
    Complete,
    Outcome,
    QuotaFull,
    Report,
    Reservation,
    check_quota,
)
from ._policy import IdempotencyPolicy

__all__ = ["Codec", "IdempotentFunction", "JSONCodec", "idempotent_function"]

logger = logging.getLogger("porch.idempotency")

P = ParamSpec("P")
R = TypeVar("R")

# Keys of functions live beside request keys, under "\x1ffn:<name>" where a request's caller
# scope stands ("cred:..." or "client:..." by default). A request's scope never holds \x1f
# (the middleware refuses one that does) and its key is printable, so no request reaches
# a function's key, whatever its scope function returns.
_SCOPE = "\x1ffn:"
_MAX_KEY = 255
_MAX_NAME = 128
# A sync call's wait for the background loop is bounded past the policy's own wait.
_LOOP_MARGIN = 60.0


class Codec(Protocol):
    """How a result is stored: ``encode`` to bytes, ``decode`` back (every call's answer)."""

    media_type: bytes

    def encode(self, value: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


class JSONCodec:
    """Results as JSON (the default): what ``json.dumps`` takes; NaN and infinities refused."""

    __slots__ = ()

    media_type = b"application/json"

    def encode(self, value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8")

    def decode(self, data: bytes) -> Any:
        return json.loads(data)


KeyFrom = Callable[..., str] | str | None
ArgumentsFingerprint = Callable[..., "bytes | str"] | None


class IdempotentFunction(Generic[P, R]):
    """A function that runs once per key (see :func:`idempotent_function`).

    Calling it derives the key from the arguments; :meth:`with_key` gives one.
    Every call with the key returns the same value — the first successful
    call's result, through the codec (the first caller gets it decoded too, so
    every caller sees the same). Raises :class:`~porch.errors.KeyReusedError` when the
    key's stored result is for other arguments, :class:`~porch.errors.KeyInProgressError`
    when the running call took longer than ``wait_timeout`` (or at once with
    ``concurrent="conflict"``), and what the pool raises (``SaturatedError``,
    ``StoreError``, ``PoolClosedError``) when it cannot decide.
    """

    def __init__(
        self,
        func: Callable[P, R],
        *,
        pool: KeyPool,
        name: str,
        key: KeyFrom,
        fingerprint: ArgumentsFingerprint | str,
        policy: IdempotencyPolicy,
        codec: Codec,
        quota: Quota,
        integrity: IntegrityKeys | None = None,
    ) -> None:
        self.func = func
        self.pool = pool
        self.name = name
        self.policy = policy
        self.codec = codec
        self.quota = quota
        self.scope = _SCOPE + name
        self.integrity = integrity
        # No client address here: the function's scope is its caller, for both quotas.
        self.reservation = Reservation(self.scope, self.scope, quota, policy.max_stored)
        self._key = key
        self._fingerprint = fingerprint
        self._signature = inspect.signature(func)
        self._async = _is_async(func)
        self._loop: Any = None  # the sync path's background loop, made at first use
        self._loop_guard = threading.Lock()
        metrics = pool.metrics
        # Bound once: a call increments, it never looks labels up.
        self._calls: dict[str, Any] | None = None
        self._waits: Any = None
        if metrics is not None:
            self._calls, self._waits = metrics.function(name)
        functools.update_wrapper(self, func)

    def _count(self, outcome: str) -> None:
        """Count one call's outcome (see porch.metrics.FUNCTION_OUTCOMES)."""
        if self._calls is not None:
            self._calls[outcome].inc()

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.with_key(None)(*args, **kwargs)

    def with_key(self, key: str | None) -> Callable[P, R]:
        """The function, called under ``key`` (None: the key from the arguments)."""
        if self._async:

            async def call_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                scoped, digest = self._identify(key, args, kwargs)
                return await self._run_async(scoped, digest, args, kwargs)

            return cast(Callable[P, R], call_async)

        def call_sync(*args: P.args, **kwargs: P.kwargs) -> R:
            scoped, digest = self._identify(key, args, kwargs)
            return cast(R, self._run_sync(scoped, digest, args, kwargs))

        return call_sync

    def _identify(
        self, given: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, bytes]:
        """The scoped store key and the digest of the arguments."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        digest = _arguments_digest(self.name, self._fingerprint, bound, args, kwargs)
        if given is not None:
            key: object = given
        elif self._key is None:
            key = digest.hex()
        elif isinstance(self._key, str):
            key = bound.arguments[self._key]
            if isinstance(key, int) and not isinstance(key, bool):
                key = str(key)
        else:
            key = self._key(*args, **kwargs)
        if not isinstance(key, str) or not key or len(key) > _MAX_KEY:
            raise ValueError(
                f"an idempotency key must be a str of 1-{_MAX_KEY} characters, got {key!r:.80}"
            )
        return f"{self.scope}\x1f{key}", digest

    # The async path: on the caller's event loop, the pool's.

    async def _run_async(
        self, key: str, digest: bytes, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        outcome, acquire, shard = await self._acquire(key, digest)
        if outcome is not OWNER:
            return self._answer(key, outcome)
        try:
            result = await cast(Callable[..., Awaitable[Any]], self.func)(*args, **kwargs)
            body, value = self._encoded(result)
        except BaseException:
            self._count("failed")
            self._release(key, acquire.token, shard)  # nothing stored: the next call runs
            raise
        stored = await self._save(key, acquire.token, shard, digest, body)
        self._count("executed" if stored else "unstored")
        return value

    def _encoded(self, result: Any) -> tuple[bytes, Any]:
        """The result as stored, and as every caller gets it (the first one too)."""
        body = self.codec.encode(result)
        if not isinstance(body, bytes):
            raise TypeError(f"{self.name}: the codec must encode to bytes, got {type(body)}")
        return body, self.codec.decode(body)

    async def _acquire(self, key: str, digest: bytes) -> tuple[Outcome, Acquire, int]:
        pool = self.pool
        policy = self.policy
        wait = policy.wait_timeout if policy.concurrent == "wait" else 0.0
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        acquire = Acquire(future, key, digest, wait, self.reservation)
        try:
            if not pool.started:
                await pool.start()
            shard = pool.submit(key, acquire)
            try:
                outcome = await future
            except asyncio.CancelledError:
                # Cancelled just as ownership arrived: the claim must not be left held.
                if future.done() and not future.cancelled() and future.result() is OWNER:
                    self._release(key, acquire.token, shard)
                raise
        except TimeoutError:
            self._count("conflict")
            if wait > 0 and self._waits is not None:
                self._waits.inc()
            raise KeyInProgressError(
                f"{self.name}: a call with this key is still running (waited {wait:.1f} s)"
            ) from None
        except (SaturatedError, StoreError, PoolClosedError):
            self._count("unavailable")
            raise
        if wait > 0 and acquire.waited and self._waits is not None:
            self._waits.inc()
        return outcome, acquire, shard

    def _answer(self, key: str, outcome: Outcome) -> Any:
        """A duplicate's answer: the stored result (checked first, with an integrity key);
        or the key was used for other arguments; or the result could not be stored."""
        if isinstance(outcome, StoredResponse):
            if self.integrity is not None and not self.integrity.verify(key, outcome):
                self._count("integrity")
                logger.error(
                    "porch: %s's stored result failed its integrity check (written without"
                    " integrity_key, or tampered with); not returned",
                    self.name,
                )
                raise IntegrityError(f"{self.name}: the stored result failed its integrity check")
            if outcome.parts is not None:  # never stored so: a result is stored whole
                self._count("unavailable")
                raise StoreError(f"{self.name}: the stored result is kept in parts")
            self._count("replayed")
            return self.codec.decode(outcome.body)
        if isinstance(outcome, QuotaFull):
            self._count("quota")
            whose = "the store's" if outcome.bucket == "total" else "this function's"
            raise QuotaFullError(
                f"{self.name}: {whose} stored results have reached their quota: its result"
                " could not be stored, so it was not run; retry once earlier results expire",
                outcome.bucket,
            )
        self._count("mismatch")
        raise KeyReusedError(
            f"{self.name}: this key's stored result is for a call with other arguments"
        )

    def _release(self, key: str, token: int, shard: int) -> None:
        self._report(key, token, shard, None).add_done_callback(_retrieve)

    def _report(
        self, key: str, token: int, shard: int, stored: StoredResponse | None
    ) -> asyncio.Future[Report]:
        done: asyncio.Future[Report] = asyncio.get_running_loop().create_future()
        call = Complete.of(
            done, key, token, stored, self.policy.ttl, self.scope, self.quota, self.scope
        )
        try:
            self.pool.submit(key, call, must_deliver=True, shard=shard)
        except Exception as exc:  # the pool closed: the store ends the claim itself
            done.set_exception(exc)
        return done

    async def _save(self, key: str, token: int, shard: int, digest: bytes, body: bytes) -> bool:
        """Store the result (ends the claim); whether it was stored. A failure to store is
        logged, not raised: the work is done, and its caller gets its result."""
        stored = StoredResponse(digest, 200, ((b"content-type", self.codec.media_type),), body)
        if self.integrity is not None:
            stored = self.integrity.sign(key, stored)
        # What its claim reserved holds it: key, digest, head (and MAC) and body, counted
        # as the store counts them.
        if stored_size(key, stored) > self.policy.max_stored:
            logger.warning(
                "porch: %s's result over max_stored=%d bytes was not stored; key released",
                self.name,
                self.policy.max_stored,
            )
            self._release(key, token, shard)
            return False
        try:
            outcome = await self._report(key, token, shard, stored)
        except Exception as exc:
            # The work is done: return its result, but say that a retry will run it again.
            logger.error("porch: could not store %s's result for replay: %s", self.name, exc)
            return False
        if outcome != "saved":
            logger.error("porch: %s's result was not stored (%s)", self.name, outcome)
            return False
        return True

    # The sync path: the pool runs on a background loop; the function on the caller's thread.

    def _run_sync(
        self, key: str, digest: bytes, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        loop = self._background()
        bound = self.policy.wait_timeout + _LOOP_MARGIN
        started: list[asyncio.Task[Any]] = []  # the acquire's task, once it runs

        async def acquiring() -> tuple[Outcome, Acquire, int]:
            task = asyncio.current_task()
            if task is not None:
                started.append(task)
            return await self._acquire(key, digest)

        pending = asyncio.run_coroutine_threadsafe(acquiring(), loop)
        try:
            outcome, acquire, shard = pending.result(bound)
        except concurrent.futures.TimeoutError:
            # The store did not answer in time: give up the call, never hold the key.
            # Decided on the loop: from here the acquire could end as the owner just as
            # it is cancelled, and that answer, and the claim, would be lost.
            loop.call_soon_threadsafe(self._give_up, key, pending, started)
            self._count("unavailable")
            raise StoreError(f"{self.name}: no answer from the store in {bound:.0f} s") from None
        if outcome is not OWNER:
            return self._answer(key, outcome)
        try:
            result = self.func(*args, **kwargs)
            body, value = self._encoded(result)
        except BaseException:
            self._count("failed")
            loop.call_soon_threadsafe(self._release, key, acquire.token, shard)
            raise
        stored = asyncio.run_coroutine_threadsafe(
            self._save(key, acquire.token, shard, digest, body), loop
        ).result(bound)
        self._count("executed" if stored else "unstored")
        return value

    def _give_up(
        self,
        key: str,
        pending: concurrent.futures.Future[tuple[Outcome, Acquire, int]],
        started: list[asyncio.Task[Any]],
    ) -> None:
        """On the loop: a sync caller stopped waiting for its acquire. Not started yet, it
        never will; under way, it is cancelled (a claim it took meanwhile is released by
        the cancelled acquire); ended as the owner, nobody will run the function or
        report: its claim is released."""
        if not started:
            pending.cancel()
            return
        task = started[0]
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            outcome, acquire, shard = task.result()
            if outcome is OWNER:
                self._release(key, acquire.token, shard)

    def _background(self) -> asyncio.AbstractEventLoop:
        from ..integrations.wsgi._loop import BackgroundLoop

        with self._loop_guard:
            if self._loop is None:
                self._loop = BackgroundLoop(self.pool)
            loop: asyncio.AbstractEventLoop = self._loop.get()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("a sync idempotent function cannot be called on its pool's loop")
        return loop

    def close(self) -> None:
        """Sync functions: close the pool and stop its background loop (also done at exit)."""
        with self._loop_guard:
            background, self._loop = self._loop, None
        if background is not None:
            background.stop()


def idempotent_function(
    pool: KeyPool,
    *,
    key: KeyFrom = None,
    name: str | None = None,
    policy: IdempotencyPolicy | None = None,
    fingerprint: ArgumentsFingerprint | str = "json",
    codec: Codec | None = None,
    quota: Quota | None = None,
    integrity_key: bytes | Sequence[bytes] | None = None,
) -> Callable[[Callable[P, R]], IdempotentFunction[P, R]]:
    """Make a function run once per key, with the store and guarantees of HTTP idempotency.

    ``key``: a function of the call's arguments returning the key, the name of the
    parameter holding it (a str or an int), or None — the digest of the arguments
    (the same arguments are the same call). ``name`` keeps this function's keys apart
    from others' (default: its module and qualified name; keep it when renaming).
    ``policy``: ``ttl``, ``wait_timeout``, ``concurrent`` and ``max_stored`` apply
    (the rest is HTTP's). ``fingerprint``: what of the arguments must match for a
    stored result to be returned — ``"json"`` (all of them, as canonical JSON; an
    argument JSON cannot encode is a TypeError), a function of the arguments, or None
    (nothing: the key alone). ``codec`` stores results (default :class:`JSONCodec`).
    ``quota`` caps this function's stored bytes as a caller scope's (default:
    IdempotencyMiddleware's); a call's claim reserves ``policy.max_stored`` bytes of it
    before the function runs, and a full quota raises QuotaFullError instead of running
    it. ``integrity_key`` (as IdempotencyMiddleware's: 16+ bytes the store never sees, a
    list rolls keys) signs stored results, and a stored result that fails its check
    raises IntegrityError instead of being returned.

    Async functions run on the caller's event loop with ``pool``, which may be the
    app's. A sync function's pool runs on a background loop of its own (as the WSGI
    bridge's does): give it a pool no event loop uses, over the same store.
    """
    from ._middleware import DEFAULT_QUOTA

    if not isinstance(pool, KeyPool):
        raise ConfigurationError("pool must be a porch KeyPool")
    if policy is not None and not isinstance(policy, IdempotencyPolicy):
        raise ConfigurationError(f"policy must be an IdempotencyPolicy, got {policy!r}")
    if key is not None and not isinstance(key, str) and not callable(key):
        raise ConfigurationError(f"key must be a parameter name or a function, got {key!r}")
    if fingerprint is not None and fingerprint != "json" and not callable(fingerprint):
        raise ConfigurationError(
            f"fingerprint must be 'json', a function or None, got {fingerprint!r}"
        )
    chosen_codec = codec if codec is not None else JSONCodec()
    chosen_policy = policy if policy is not None else IdempotencyPolicy()
    chosen_quota = quota if quota is not None else DEFAULT_QUOTA
    # Every call reserves max_stored bytes before it runs: each cap must hold one.
    check_quota(chosen_quota, chosen_policy.max_stored)
    integrity = None if integrity_key is None else IntegrityKeys(integrity_key)

    def decorate(func: Callable[P, R]) -> IdempotentFunction[P, R]:
        if not callable(func):
            raise ConfigurationError(f"idempotent_function wraps a function, got {func!r}")
        chosen = name if name is not None else _qualified(func)
        if not chosen or len(chosen) > _MAX_NAME or "\x1f" in chosen:
            raise ConfigurationError(
                f"name must be 1-{_MAX_NAME} characters without \\x1f, got {chosen!r:.80}"
            )
        if isinstance(key, str) and key not in inspect.signature(func).parameters:
            raise ConfigurationError(f"key {key!r} is no parameter of {_qualified(func)}")
        return IdempotentFunction(
            func,
            pool=pool,
            name=chosen,
            key=key,
            fingerprint=fingerprint,
            policy=chosen_policy,
            codec=chosen_codec,
            quota=chosen_quota,
            integrity=integrity,
        )

    return decorate


def _is_async(func: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(func):
        return True
    call = getattr(type(func), "__call__", None)  # noqa: B004 - a method, not callability
    return not inspect.isfunction(func) and inspect.iscoroutinefunction(call)


def _qualified(func: Callable[..., Any]) -> str:
    kind = func if inspect.isfunction(func) or inspect.ismethod(func) else type(func)
    return f"{kind.__module__}.{kind.__qualname__}"


def _arguments_digest(
    name: str,
    fingerprint: ArgumentsFingerprint | str,
    bound: inspect.BoundArguments,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bytes:
    """What makes two calls "the same": the function's name and (by ``fingerprint``) its
    arguments. Length-prefixed, as a request's digest is."""
    if fingerprint is None:
        part = b""
    elif callable(fingerprint):
        value = fingerprint(*args, **kwargs)
        part = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
        if not isinstance(part, bytes):
            raise TypeError(f"an arguments fingerprint must return bytes or str, got {value!r}")
    else:
        try:
            part = json.dumps(
                bound.arguments, sort_keys=True, separators=(",", ":"), allow_nan=False
            ).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{name}: the arguments are not JSON ({exc}); pass idempotent_function"
                " fingerprint= a function of them, or None"
            ) from None
    encoded = name.encode("utf-8", "surrogatepass")
    h = hashlib.blake2b(b"fn%d:%s%d:" % (len(encoded), encoded, len(part)), digest_size=32)
    h.update(part)
    return h.digest()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
