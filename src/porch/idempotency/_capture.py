"""Capturing the owner's response for replay, in the shape of Starlette's gzip responder.

The owner's response streams to its client while a copy is kept; the last body
chunk is held until the stored copy is committed, so a client that received a
complete response can always have it replayed. A body bigger than one part of
the store's PartStore is not kept whole: it goes to the store part by part as the
app sends it (its MAC computed as it passes), and the Save that follows its last
part names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from collections.abc import Sequence
from typing import Protocol

from .._types import Message, Send
from ..errors import PoolClosedError, StoreError
from ..store.base import Parts, PartStore, StoredResponse, stored_size
from ._events import IdempotencyEvents
from ._integrity import MAC_SIZE, BodyMac, IntegrityKeys
from ._ownership import Report, Reservation

__all__ = ["REPLAYED_HEADERS", "TOKEN", "Capture", "Owner", "storable"]

logger = logging.getLogger("porch.idempotency")

REPLAYED_HEADERS = frozenset({b"content-type", b"location", b"etag", b"content-location"})
_UNSTORED_STATUSES = frozenset({408, 409, 425, 429})

# A header field name (RFC 9110 token).
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# What servers refuse to send in a header value (the set uvicorn checks): CTLs but HTAB.
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class CapturePolicy(Protocol):
    """What a capture reads of its rule's policy (an IdempotencyPolicy)."""

    @property
    def ttl(self) -> float: ...

    @property
    def max_stored(self) -> int: ...

    def stores(self, status: int) -> bool:
        """Whether a response with ``status`` is stored."""
        ...


class Owner(Protocol):
    """What a capture reports to (the idempotency middleware that made it)."""

    events: IdempotencyEvents
    integrity: IntegrityKeys | None
    """The keys stored responses are signed with (None: not signed)."""
    header_names: dict[bytes, bytes]
    """Response header names found valid, and their replayed form (see :func:`head`)."""
    parts: PartStore | None
    """Where bodies bigger than a part go, part by part (None: kept whole)."""

    def report_owner(
        self,
        key: str,
        token: int,
        reservation: Reservation,
        response: StoredResponse | None,
        shard: int,
        ttl: float | None = None,
    ) -> asyncio.Future[Report]:
        """Save ``response`` (None: release the key) for the owner holding ``token``, kept
        ``ttl`` seconds."""
        ...


def storable(status: int) -> bool:
    """2xx-4xx are stored, except the ones that say "try again": 408, 409, 425, 429."""
    return 200 <= status < 500 and status not in _UNSTORED_STATUSES


def _invalid_header(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The first header whose bytes a server would refuse to send (a name that is no token,
    CR/LF/NUL or another control byte in a value), or None."""
    for name, value in headers:
        if TOKEN.fullmatch(name) is None or _BAD_VALUE.search(value) is not None:
            return bytes(name)
    return None


# Bound of a head-names dict (see head): a handler inventing names cannot grow it; past
# the bound, new names are checked every time.
NAMES_MAX = 1024


def _known(name: bytes, names: dict[bytes, bytes]) -> bytes | None:
    """``name``'s entry for ``names`` (learnt if there is room); None if it is no token."""
    if TOKEN.fullmatch(name) is None:
        return None
    lower = name.lower()
    kept = lower if lower in REPLAYED_HEADERS else b""
    if len(names) < NAMES_MAX:
        names[name] = kept
    return kept


def head(
    headers: Sequence[tuple[bytes, bytes]], names: dict[bytes, bytes]
) -> tuple[tuple[tuple[bytes, bytes], ...], bytes | None]:
    """The headers a replay keeps (``REPLAYED_HEADERS``, names lowercased), and the first
    header a server would refuse to send (see _invalid_header), or None.

    ``names`` holds names already found to be tokens -> the form a replay keeps them
    under (lowercased), or b"" if it does not keep them; its owner (a middleware) passes
    the same dict every time. A response head repeats the same few names, so the usual
    head costs a dict lookup per name, not a regex call and a lower()."""
    kept: list[tuple[bytes, bytes]] = []
    values: list[bytes] = []
    try:
        for name, value in headers:
            as_kept = names.get(name)
            if as_kept is None:
                as_kept = _known(name, names)
                if as_kept is None:
                    break  # no token: found one by one below
            values.append(value)
            if as_kept:
                kept.append((as_kept, value))
        else:
            # The values all at once (joined by HTAB, which they may hold): one regex call.
            if _BAD_VALUE.search(b"\t".join(values)) is None:
                return tuple(kept), None
    except TypeError:
        pass  # not bytes (a bytearray is no dict key): checked one by one below
    invalid = _invalid_header(headers)
    kept = []
    for name, value in headers:
        name = name.lower()
        if name in REPLAYED_HEADERS:
            kept.append((name, value))
    return tuple(kept), invalid


class Capture:
    """Streams the owner's response to the client and keeps a copy for the store.

    The last body chunk is held until the stored copy is committed: a client
    that received a complete response can always have it replayed, even if the
    process dies the next instant. A copy that grows past one part of the store's
    PartStore goes there part by part as it comes (``held``: the bytes kept here
    meanwhile, at most a part and a chunk, besides the part being written), so
    memory does not grow with the body.
    """

    __slots__ = (
        "body",
        "caller",
        "chunks",
        "count",
        "digest",
        "failed",
        "headers",
        "held",
        "invalid",
        "key",
        "length",
        "mac",
        "oversized",
        "owner",
        "parts",
        "policy",
        "reported",
        "reservation",
        "send",
        "shard",
        "size",
        "start",
        "status",
        "token",
        "writing",
    )

    def __init__(
        self,
        send: Send,
        owner: Owner,
        policy: CapturePolicy,
        key: str,
        token: int,
        reservation: Reservation,
        digest: bytes,
        shard: int,
    ) -> None:
        self.send = send
        self.owner = owner
        self.policy = policy
        self.key = key
        self.token = token
        self.reservation = reservation
        self.caller = reservation.scope
        self.digest = digest
        self.shard = shard  # the key's shard (KeyPool.submit's answer to the Acquire)
        self.status = 0
        self.start: Message | None = None
        self.headers: tuple[tuple[bytes, bytes], ...] = ()
        self.chunks: list[bytes] = []
        self.held = 0  # bytes in chunks
        self.size = 0
        self.oversized = False
        self.invalid: bytes | None = None
        self.reported = False
        self.parts = owner.parts
        self.failed = False  # a part could not be written: nothing is stored
        self.body = 0  # the id of the body in parts, once one was written
        self.count = 0  # parts written
        self.length = 0  # bytes in them
        self.mac: BodyMac | None = None
        self.writing: asyncio.Future[None] | None = None  # the part being written

    def report(self, response: StoredResponse | None) -> asyncio.Future[Report]:
        self.reported = True
        return self.owner.report_owner(
            self.key, self.token, self.reservation, response, self.shard, self.policy.ttl
        )

    def abandon(self) -> None:
        """The app ended without a response to store (it raised, or was cancelled): release
        the key and drop any parts written."""
        self._drop_parts()
        if not self.reported:
            self.report(None)

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers, self.invalid = head(message.get("headers", ()), self.owner.header_names)
            # What is stored counts against max_stored (the bytes its claim reserved): the
            # key, digest and replayed headers, then the body as it streams.
            self.size = stored_size(self.key, StoredResponse(self.digest, 0, self.headers, b""))
            if self.owner.integrity is not None:
                self.size += MAC_SIZE
            # Held until the first body chunk: a one-chunk response (the usual
            # kind) then leaves as head and body together, after its commit,
            # not as a head now and a body a commit later.
            self.start = message
            return
        if kind == "http.response.body" and not self.reported:
            chunk: bytes = message.get("body", b"")
            more = message.get("more_body", False)
            if not self.oversized and not self.failed:
                self.size += len(chunk)
                if self.size > self.policy.max_stored:
                    self.oversized = True
                    self.chunks.clear()
                    self.held = 0
                    self._drop_parts()
                else:
                    if chunk:
                        self.chunks.append(chunk)
                        self.held += len(chunk)
                    parts = self.parts
                    if more and parts is not None and self.held > parts.part_bytes:
                        await self._write_parts(parts, final=False)
            if not more:
                await self._complete()
        if self.start is not None:
            start, self.start = self.start, None
            await self.send(start)
        await self.send(message)

    async def _write_parts(self, parts: PartStore, *, final: bool) -> None:
        """Write what is held as whole parts (``final``: the rest too, as the last part,
        and wait until every part is written).

        One part is written while the app goes on: a part's write is awaited only before
        the next one starts (or, at the end, before the body is kept), so the app
        produces the next part while the store takes this one."""
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.held = 0
        if not self.body:
            self.body = secrets.randbits(63) or 1
            integrity = self.owner.integrity
            if integrity is not None:
                self.mac = integrity.streaming(self.key, self.digest, self.status, self.headers)
        size = parts.part_bytes
        view = memoryview(data)
        start = 0
        while len(data) - start >= size or (final and start < len(data)):
            whole = start == 0 and len(data) <= size
            piece = data if whole else bytes(view[start : start + size])
            if not await self._written():
                return
            self.writing = asyncio.ensure_future(
                parts.write(self.key, self.body, self.count, piece)
            )
            if self.mac is not None:
                self.mac.update(piece)
            self.count += 1
            self.length += len(piece)
            start += len(piece)
        if final:
            await self._written()
        elif start < len(data):
            rest = data[start:]
            self.chunks.append(rest)
            self.held = len(rest)

    async def _written(self) -> bool:
        """Wait for the part being written; False (nothing more is stored) if it failed."""
        writing, self.writing = self.writing, None
        if writing is not None:
            try:
                # Shielded: a cancelled owner's part may reach the store all the same (a
                # network store's command on its way), so it is left to finish and the
                # drop that follows waits for it (_drop_parts).
                await asyncio.shield(writing)
            except asyncio.CancelledError:
                self.writing = writing
                raise
            except StoreError as exc:
                self.failed = True
                self._drop_parts()
                self._not_stored(exc)
        return not self.failed

    def _drop_parts(self) -> None:
        writing, self.writing = self.writing, None
        body, self.body = self.body, 0
        parts, key = self.parts, self.key
        if not body or parts is None:
            if writing is not None:
                writing.add_done_callback(_retrieve)
            return
        if writing is None:
            parts.drop(key, body)
            return

        # The part being written is left to finish, its outcome nobody's. The drop waits
        # for it: the write reaches the store a loop step after it was started (and a
        # network store may run it on another connection), so a drop sent now could land
        # first and leave that part behind until its grace (PART_GRACE) is over.
        def drop(written: asyncio.Future[None]) -> None:
            _retrieve(written)
            parts.drop(key, body)

        writing.add_done_callback(drop)

    def _not_stored(self, exc: BaseException) -> None:
        # The handler's work is done: deliver the response, but say loudly that a retry
        # will not be able to replay it. Throttled: with the store down, every owner
        # would say it.
        self.owner.events.log.event(
            logging.ERROR,
            ("store", "save"),
            asyncio.get_running_loop().time(),
            1.0,
            "porch: could not store the response for replay: %s",
            exc,
            scope=self.caller,
            outcome="not_stored",
            cause="store",
        )

    async def _complete(self) -> None:
        """The app finished its response: store it (if storable) before the last chunk leaves."""
        if (
            self.invalid is not None
            or self.oversized
            or self.failed
            or not self.policy.stores(self.status)
        ):
            if self.invalid is not None:
                # The server will refuse to send it; stored, every retry would fail the
                # same way for the whole ttl. Passed on as is: the server decides.
                logger.warning(
                    "porch: response has an invalid header %s; not stored, key released",
                    self.invalid[:64],
                )
            elif self.oversized:
                logger.warning(
                    "porch: response over max_stored=%d bytes was not stored; key released",
                    self.policy.max_stored,
                )
            self.abandon()
            return
        parts = self.parts
        if parts is not None and (self.body or self.held > parts.part_bytes):
            stored = await self._keep_parts(parts)
            if stored is None:
                return
        else:
            stored = StoredResponse(self.digest, self.status, self.headers, b"".join(self.chunks))
            if self.owner.integrity is not None:
                stored = self.owner.integrity.sign(self.key, stored)
        report = self.report(stored)
        # The outcome is dealt with where it lands (before this task resumes), also when
        # the owner is cancelled meanwhile: the Save is delivered all the same, and parts
        # no record names must still go.
        report.add_done_callback(self._outcome)
        with contextlib.suppress(StoreError, PoolClosedError):  # said by _outcome
            await asyncio.shield(report)

    def _outcome(self, report: asyncio.Future[Report]) -> None:
        if report.cancelled():
            return
        exc = report.exception()
        if isinstance(exc, StoreError | PoolClosedError):
            # Its parts are not dropped: the Save may have committed all the same (its
            # answer lost). Nothing names them otherwise, and they go with their grace.
            self._not_stored(exc)
            return
        if exc is not None:
            return  # raised by the await in _complete
        outcome = report.result()
        if outcome != "saved":
            self._drop_parts()  # nothing names them
        if outcome == "quota":
            self.owner.events.unstored_over_quota(self.caller)
        elif outcome == "fenced":
            self.owner.events.count_unstored("fenced")
            # Another owner claimed the key meanwhile (this claim had ended): its
            # response is the stored one; this one is delivered but never replayed.
            logger.error(
                "porch: an idempotency owner lost its claim before saving (fenced);"
                " its response was sent but not stored"
            )

    async def _keep_parts(self, parts: PartStore) -> StoredResponse | None:
        """The rest of a body in parts written and kept: the response that names it (None:
        not stored, the key released)."""
        await self._write_parts(parts, final=True)
        if self.failed:
            self.abandon()
            return None
        ref = Parts(self.body, self.count, self.length)
        headers = self.headers
        integrity = self.owner.integrity
        if integrity is not None and self.mac is not None:
            headers = (*headers, integrity.header(self.mac, self.length))
        try:
            await parts.keep(self.key, ref, self.policy.ttl)
        except StoreError as exc:
            self._not_stored(exc)
            self.abandon()
            return None
        return StoredResponse(self.digest, self.status, headers, b"", ref)


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
