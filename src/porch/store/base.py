"""The store seam: the operations a backend applies, and the protocols it implements.

The seam is as narrow as the engines need. ``Store.apply`` takes a batch of
operations and applies all of them in one transaction (or one pipeline of
atomic server-side steps), returning only once it is durable. Each operation
carries its own inputs and receives its results.

Idempotency ownership is part of the seam, backend-neutral: a :class:`Claim`
takes a key for this process (or finds its stored response) inside the batch,
a :class:`Save` stores the owner's response *fenced* by the claim's token and
ends the claim, a :class:`Release` ends it without storing. What frees a claim
whose holder died is each backend's promise, stated in its docstring; waiting
for a claim held elsewhere goes through :class:`Claims`, never by polling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from ..clock import Clock
from .admin import StoreAdmin

__all__ = [
    "ALGORITHMS",
    "PART_GRACE",
    "SECRET_BYTES",
    "Algorithm",
    "ApplyNow",
    "ApplyThen",
    "Capabilities",
    "Claim",
    "Claims",
    "Durability",
    "Hit",
    "Lookup",
    "PartStore",
    "Parts",
    "Quota",
    "QuotaBucket",
    "Release",
    "Save",
    "SaveOutcome",
    "Settle",
    "Store",
    "StoreOp",
    "StoreStatistics",
    "StoredResponse",
    "Vacate",
    "stored_size",
]

# The size of a store's secret (Store.secret), created once with its schema.
SECRET_BYTES = 32
# Seconds after its last part was written that a body no record names is deleted (see
# PartStore): longer than an owner streaming to its slowest client takes between two
# parts (a part every 10 minutes is 1.7 KiB/s for 1 MiB parts).
PART_GRACE = 600.0

Durability = Literal["process", "power"]
"""``"process"``: a commit survives the process being killed (``kill -9``), not a power loss.
``"power"``: every group commit is synced to disk and survives a power loss."""


Algorithm = Literal["fixed", "sliding", "gcra"]
"""How a limit counts (docs/design.md, "Policies"): ``"fixed"`` windows starting at a
key's first hit; ``"sliding"``, the sliding-window counter (the previous window's count
weighted by its overlap); ``"gcra"``, a token bucket of ``burst`` units refilled at
``amount`` per ``window``, kept as its theoretical arrival time."""
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)


class Hit:
    """Count one request of ``cost`` units against one or more limits, all or nothing.

    Inputs, per limit: the counter key, the amount, the window (seconds), the
    algorithm (``algorithms``; None: every limit is ``"fixed"``) and, for gcra,
    the burst (``bursts``; None: the amounts). ``cost`` (an int >= 0) is the
    request's, the same for every limit.

    Results, filled by the store: ``allowed`` iff the hit fits every limit (a
    refused hit changes nothing at all); per limit, whether it fits (``fits``),
    the units left after the decision (``remaining``), and in seconds from the
    decision: until more units are available (``next``), until the limit is
    whole again (``full``), and the earliest time this hit could fit
    (``retry``); ``stamp``, the window the hit was counted in (what a
    :class:`Settle` names). ``wall`` is the wall time (Unix seconds) the
    decision was taken at, for the headers a client reads.

    Concurrency (docs/design.md, "Slots"): ``slots`` names one key per
    concurrency limit, ``caps`` how many requests each lets be in flight at once.
    The hit is allowed only if it also finds a free slot under every one of them,
    and then takes one of each in the same atomic step as its units (a hit a
    rate limit refuses takes no slot; a hit without a slot consumes no units).
    Results: ``token`` (> 0 once slots were taken: what the :class:`Vacate` that
    frees them names) and, per slot key, ``in_flight``: the requests holding
    one after the decision (this hit included if it took one). Slots are held
    until vacated, or until their holder dies (backend-defined; a lease is
    renewed by the store itself while the process lives).
    """

    __slots__ = (
        "algorithms",
        "allowed",
        "amounts",
        "bursts",
        "caps",
        "cost",
        "fits",
        "full",
        "in_flight",
        "keys",
        "next",
        "remaining",
        "retry",
        "slots",
        "stamp",
        "token",
        "wall",
        "windows",
    )

    def __init__(
        self,
        keys: Sequence[str],
        amounts: Sequence[int],
        windows: Sequence[float],
        algorithms: Sequence[Algorithm] | None = None,
        bursts: Sequence[int] | None = None,
        cost: int = 1,
        slots: Sequence[str] | None = None,
        caps: Sequence[int] = (),
    ) -> None:
        self.keys = keys
        self.amounts = amounts
        self.windows = windows
        self.algorithms = algorithms
        self.bursts = bursts
        self.cost = cost
        self.slots = slots
        self.caps = caps
        self.token = 0
        self.in_flight: Sequence[int] = ()
        self.allowed = False
        # Empty until the store fills them (no list allocated per hit for nothing).
        self.fits: Sequence[bool] = ()
        self.remaining: Sequence[int] = ()
        self.next: Sequence[float] = ()
        self.full: Sequence[float] = ()
        self.retry: Sequence[float] = ()
        self.stamp: Sequence[float] = ()
        self.wall = 0.0


class Settle:
    """Charge (``delta`` > 0) or refund (< 0) units on an allowed hit's limits afterwards.

    Per limit: the hit's key, amount, window, algorithm and burst, the units to
    add (``deltas``: the actual cost minus the hit's) and the hit's ``stamp``.
    A settle never refuses and may take a limit past its amount (requests are
    refused until it refills); a refund to a window that has gone changes
    nothing (docs/design.md, "Policies": the settle rule). No results.
    """

    __slots__ = ("algorithms", "amounts", "bursts", "deltas", "keys", "stamps", "windows")

    def __init__(
        self,
        keys: Sequence[str],
        amounts: Sequence[int],
        windows: Sequence[float],
        deltas: Sequence[int],
        stamps: Sequence[float],
        algorithms: Sequence[Algorithm] | None = None,
        bursts: Sequence[int] | None = None,
    ) -> None:
        self.keys = keys
        self.amounts = amounts
        self.windows = windows
        self.deltas = deltas
        self.stamps = stamps
        self.algorithms = algorithms
        self.bursts = bursts

    @classmethod
    def of(cls, hit: Hit, actual: int) -> Settle:
        """The settle of an allowed ``hit`` whose request turned out to cost ``actual``."""
        delta = actual - hit.cost
        return cls(
            hit.keys,
            hit.amounts,
            hit.windows,
            [delta] * len(hit.keys),
            hit.stamp,
            hit.algorithms,
            hit.bursts,
        )


@dataclass(frozen=True, slots=True)
class Parts:
    """A stored body kept in parts apart from its record (see :class:`PartStore`): what a
    replay reads, part by part, instead of a body held whole in memory."""

    #: The body's id in its store: random, 63 bits, never reused for another body.
    id: int
    #: How many parts (read by index, 0 first).
    count: int
    #: The body's bytes, all parts together.
    length: int


@dataclass(frozen=True, slots=True, init=False)
class StoredResponse:
    """A response kept for replay: what a duplicate request receives, byte for byte.

    Its body is ``body``, or, for a body streamed to the store in parts, ``b""`` and
    ``parts`` naming it (read through the store's :class:`PartStore`)."""

    digest: bytes
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    parts: Parts | None

    def __init__(
        self,
        digest: bytes,
        status: int,
        headers: tuple[tuple[bytes, bytes], ...],
        body: bytes,
        parts: Parts | None = None,
    ) -> None:
        # The generated __init__ of a frozen dataclass sets each field through
        # object.__setattr__ (~0.7 us for these four); the slots' own descriptors set
        # them in half that. One is built per first execution and per replay.
        _set_digest(self, digest)
        _set_status(self, status)
        _set_headers(self, headers)
        _set_body(self, body)
        _set_parts(self, parts)

    @property
    def length(self) -> int:
        """The body's bytes, wherever it is kept."""
        parts = self.parts
        return len(self.body) if parts is None else parts.length


_set_digest = vars(StoredResponse)["digest"].__set__
_set_status = vars(StoredResponse)["status"].__set__
_set_headers = vars(StoredResponse)["headers"].__set__
_set_body = vars(StoredResponse)["body"].__set__
_set_parts = vars(StoredResponse)["parts"].__set__


class Lookup:
    """Read the stored response of a scoped key (``None``: none, or expired); no claim.

    An expired row found here may be deleted in the same transaction (pruned when touched).
    """

    __slots__ = ("key", "result")

    def __init__(self, key: str) -> None:
        self.key = key
        self.result: StoredResponse | None = None


class Claim:
    """Take a scoped idempotency key for this process, or find its stored response.

    In one atomic step, in this order: if the key's claim is held by a live
    holder elsewhere, nothing is taken (``held``; ``retry_after`` is the
    seconds until that holder's lease ends, or ``None`` where claims die with
    their holder). Otherwise a live stored response is returned in ``stored``
    and nothing is taken. Otherwise the claim is taken: ``token`` is a fence,
    strictly greater than every token issued for this key before, and the
    claim stays held until a :class:`Save`/:class:`Release` with that token, or
    until the holder dies (backend-defined; a lease is renewed by the store
    itself while the process lives).

    With a ``quota``, taking the claim also reserves ``reserve`` bytes against
    the caller ``scope``, the ``client`` identity and the whole store, in the
    same step: if any of the three would pass its cap (live bytes and the
    reservations of live claims; expired responses and the reservations of
    claims whose holder is gone are reclaimed first), nothing is taken and
    ``over`` names it (``"scope"``, ``"client"`` or ``"total"``). The
    reservation lives as long as the claim: a :class:`Save` with its token
    replaces it by the response's size, a :class:`Release` (or the holder's
    death) frees it, so a save of at most ``reserve`` bytes always fits.
    """

    __slots__ = (
        "client",
        "held",
        "key",
        "over",
        "quota",
        "reserve",
        "retry_after",
        "scope",
        "stored",
        "token",
    )

    def __init__(
        self,
        key: str,
        *,
        scope: str = "",
        client: str = "",
        quota: Quota | None = None,
        reserve: int = 0,
    ) -> None:
        self.key = key
        self.scope = scope
        self.client = client
        self.quota = quota
        self.reserve = reserve
        self.stored: StoredResponse | None = None
        self.token = 0  # > 0 once claimed
        self.held = False
        self.retry_after: float | None = None
        self.over: QuotaBucket | None = None


@dataclass(frozen=True, slots=True)
class Quota:
    """Caps on stored response bytes: per caller scope, per client identity (whatever
    scopes it presents: new credentials buy no new allowance), and for the whole store.

    The client's default is half the scope's: what one address may make porch keep on
    disk is its stored responses plus the write-ahead log they pass through (the SQLite
    store's WAL may hold several MiB between checkpoints), and 600 keyed 64 KiB demo
    orders from one address, each with a new cookie, must grow porch's files by at most
    16 MiB (tests/e2e/test_gate_threats.py::test_new_cookies_buy_no_new_room)."""

    scope_bytes: int = 8 << 20
    total_bytes: int = 1 << 30
    client_bytes: int = 4 << 20


QuotaBucket = Literal["scope", "client", "total"]
"""Which cap of a :class:`Quota` a claim or save would have passed."""


def stored_size(key: str, response: StoredResponse) -> int:
    """The bytes a stored response counts against its quotas, on every backend: its key,
    request digest, replayed headers (names and values) and body (in parts or not)."""
    return (
        len(key.encode("utf-8", "surrogatepass"))
        + len(response.digest)
        + sum([len(name) + len(value) for name, value in response.headers])
        + response.length
    )


SaveOutcome = Literal["pending", "saved", "fenced", "quota"]


class Save:
    """Store ``response`` under a scoped key for ``ttl`` s, fenced by ``token``; end the claim.

    ``outcome``: ``"saved"``; ``"fenced"`` when the claim with ``token`` is no
    longer the key's current claim (a newer owner's response is never
    overwritten; nothing is written); ``"quota"`` when storing ``size`` bytes
    (:func:`stored_size`) would take the caller ``scope``, the ``client`` or the
    store past ``quota`` (nothing is stored, the claim ends). Live bytes are
    counted (expired rows do not count), the claim's own reservation as freed:
    a response within it always fits. ``token`` 0 saves without a claim (tests
    and tools only). Waiters elsewhere are woken.
    """

    __slots__ = ("client", "key", "outcome", "quota", "response", "scope", "size", "token", "ttl")

    def __init__(
        self,
        key: str,
        response: StoredResponse,
        ttl: float,
        *,
        token: int = 0,
        scope: str = "",
        client: str = "",
        quota: Quota | None = None,
    ) -> None:
        self.key = key
        self.response = response
        self.ttl = ttl
        self.token = token
        self.scope = scope
        self.client = client
        self.quota = quota
        self.size = stored_size(key, response)
        self.outcome: SaveOutcome = "pending"


class Release:
    """End the claim with ``token`` without storing anything; waiters elsewhere are woken.

    A token that is no longer current releases nothing (``released`` False). The
    claim's reservation (see :class:`Claim`) is freed; ``scope`` and ``client`` name
    its owner where a backend keeps the reservation under them (they may be left
    out: it is then freed when the claim would have lapsed).
    """

    __slots__ = ("client", "key", "released", "scope", "token")

    def __init__(self, key: str, token: int, *, scope: str = "", client: str = "") -> None:
        self.key = key
        self.token = token
        self.scope = scope
        self.client = client
        self.released = False


class Vacate:
    """Free the concurrency slots an allowed :class:`Hit` took: its ``slots`` and ``token``.

    Never refused; a token whose slots are gone already (their holder's lease
    ran out, the store was closed) frees nothing. ``Vacate.of(hit)`` builds it.
    """

    __slots__ = ("slots", "token")

    def __init__(self, slots: Sequence[str], token: int) -> None:
        self.slots = slots
        self.token = token

    @classmethod
    def of(cls, hit: Hit) -> Vacate:
        """The vacate of an allowed ``hit``'s slots."""
        return cls(hit.slots or (), hit.token)


StoreOp = Hit | Settle | Lookup | Claim | Save | Release | Vacate


class PartStore(Protocol):
    """Where a store keeps bodies in parts, apart from their records (a capability, see
    :attr:`Capabilities.parts`): a response too big to hold whole in memory is written
    part by part while it streams to its client, and replayed part by part.

    The protocol, for a body of one scoped key: :meth:`write` each part in order
    (index 0 first; a part is durable once its call returns), then :meth:`keep` the
    whole, then a :class:`Save` whose response names it (``StoredResponse.parts``). Only
    that Save makes a record name the body, so a crash mid-stream leaves parts no record
    names: they are deleted by the store some time after their last write (``PART_GRACE``),
    and never replayed. A kept body lives at least as long as any record naming it; a
    record's body is deleted with it (at once, or when it would have expired).
    """

    #: The size of every part but the last (the writer cuts the body so).
    part_bytes: int

    async def write(self, key: str, body: int, index: int, data: bytes) -> None:
        """Keep part ``index`` of body ``body`` (a random 63-bit id) of ``key``, durably.
        Raise StoreError when it cannot be kept."""
        ...

    async def keep(self, key: str, parts: Parts, ttl: float) -> None:
        """The body is complete: keep it at least ``ttl`` seconds more (beyond that, as long
        as a record names it). Raise StoreError if it is not whole (``parts.count`` parts
        of ``parts.length`` bytes): no record may then name it."""
        ...

    async def read(self, key: str, parts: Parts, index: int) -> bytes | None:
        """Part ``index`` of ``key``'s body ``parts``; None if it is not there (its record
        expired or was deleted since it was read). Raise StoreError when it cannot be read."""
        ...

    def drop(self, key: str, body: int) -> None:
        """Delete the parts of a body no record names (its Save was fenced or over quota,
        its response not stored): soon, in the background, errors logged. The parts
        written before it, that is: a caller drops only once every write of the body
        it started has returned (or failed)."""
        ...


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """What a store has done since it was opened."""

    transactions: int
    operations: int
    failures: int


class Claims(Protocol):
    """Waiting for a claim held elsewhere (another process or host): no polling."""

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        """Call ``wake()`` once, on the event loop, when ``key``'s claim may have come free.

        That is: its holder saved or released it, its holder died, or (for
        leases) ``retry_after`` seconds passed. A spurious wake is allowed (the
        caller claims again); a missed one is not. Returns a function that
        cancels the watch.
        """
        ...


ApplyThen = Callable[[Sequence[StoreOp], Callable[[BaseException | None], None]], None]
"""Apply ops in one transaction, then call ``done(None)`` (or ``done(error)``) on the
calling loop, from where the commit is known: see :attr:`Capabilities.apply_then`."""

ApplyNow = Callable[[Sequence[StoreOp]], bool]
"""Commit ops on the calling task now if that is cheap: True once committed, False if
nothing was applied: see :attr:`Capabilities.apply_now`."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store offers beyond :class:`Store`'s methods, declared once.

    The key pool and the middlewares read it when they are built; a store without a
    capability keeps the field's default. Nothing else about a store is looked up.
    """

    shards: int = 4
    """The shard count a ``KeyPool(size=None)`` takes. SQLite says 1: its one writer
    commits every shard's batches in one transaction anyway, so more shards only add
    hand-offs on the event loop; a network store's shards send batches side by side."""

    in_flight: int = 1
    """Batches one shard may have applying at once: 1 keeps a shard's batches strictly
    one after another (SQLite's one writer gains nothing from more); a remote store
    whose round trip, not its server's work, bounds a shard says more, and the pool
    then sends a shard's next batch while earlier ones are out, replying in order."""

    clock: Clock | None = None
    """The clock the store decides on, when that is this process's (SQLite's injected
    clock): the middlewares default to it, so a test's ManualClock moves both. None:
    the store decides on its server's clock."""

    apply_then: ApplyThen | None = None
    """Apply and call back once committed (SQLite's writer thread, or an inline
    commit): a shard answers its callers from that callback, one loop hop fewer per
    request than waking the shard's task to answer them."""

    apply_now: ApplyNow | None = None
    """Commit a lone hit on the calling task, at once, when nothing else is in flight
    (SQLite with ``durability="process"``: a write into the page cache, never an
    fsync): see ``KeyPool.apply_now``. Only used with ``in_flight == 1``."""

    solo_save_bytes: int | None = None
    """A :class:`Save` of a body above this many bytes leaves its shard's batch and is
    applied on its own, so other callers' decisions never wait for it (SQLite keeps
    such a body in its side file, written apart). None: saves stay in their batch."""

    admin: Callable[[], StoreAdmin] | None = None
    """The operator's view of the store (``porch inspect|reset|purge|check``)."""

    parts: PartStore | None = None
    """Where bodies too big to hold whole are kept in parts (see :class:`PartStore`):
    responses above its ``part_bytes`` are streamed to it and replayed from it. None: a
    stored response is held whole in memory while it is saved and replayed."""

    algorithms: frozenset[Algorithm] = frozenset({"fixed"})
    """The algorithms the store's :class:`Hit` and :class:`Settle` decide (see
    :data:`Algorithm`): a rule using another is a ConfigurationError when its
    middleware is built. Every store decides fixed windows."""

    slots: bool = False
    """Whether the store's :class:`Hit` takes concurrency slots (``Hit.slots``) and its
    :class:`Vacate` frees them: a rule with a concurrency limit on a store without is
    a ConfigurationError when its middleware is built."""

    slot_lease: float | None = None
    """How long the slots of a holder that died stay taken at most (seconds): the lease
    its heartbeat renews. None: they are freed when it dies (SQLite's OFD locks)."""


class Store(Protocol):
    """A durable backend for counters, stored responses and idempotency claims."""

    claims: Claims

    @property
    def capabilities(self) -> Capabilities:
        """What this store offers beyond these methods (read once by its users)."""
        ...

    async def open(self) -> None:
        """Connect, create or migrate the schema; idempotent."""
        ...

    async def close(self) -> None:
        """Finish queued work, end this process's claims, and release the backend.

        It may run on another event loop than :meth:`open` did, after that loop
        stopped (the pool follows its loop, then opens the store again): it must
        not wait on the old loop, and it ends in bounded time.
        """
        ...

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        """Apply ``ops`` in one transaction; return once it is committed, or raise StoreError."""
        ...

    def statistics(self) -> StoreStatistics: ...

    @property
    def secret(self) -> bytes:
        """32 random bytes created with the store's schema, the same for every process and
        host sharing it; readable once :meth:`open` returned (StoreError before). They key
        the digests of callers' credentials (``CallerScope``), so no scope that is printed,
        logged or stored can be tested against a dictionary without the store."""
        ...
