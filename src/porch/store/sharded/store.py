"""A store over several servers: each key at one home, several homes decided together.

:class:`ShardedStore` holds several stores of one kind (PostgreSQL schemas on
several servers, or several standalone Redis primaries) and sends each key to
one of them, its *home* (:mod:`.homes`: rendezvous hashing over the stores'
secrets). Everything about one key (its counter, its slot, its claim, its
stored response and its parts) happens on its home only, under that store's own
locks, exactly as on a store alone.

A batch (``apply``) is split by home and each home's part applied on its store,
side by side. A hit whose limits live on several homes (a rule's client level on
one, its organisation's or everyone's on another) is decided in steps, one home
after another in the order of the hit's keys: it takes its units on the first
home, then the next, and once one refuses, the units it took on the earlier ones
are given back (a refund, and its slots vacated). What that allows concurrent
requests to see is stated in docs/stores/sharding.md, "Several homes": a request
may be refused because of units another request held for a round trip and then
gave back; no request is ever allowed past a limit.

A home whose server fails fails only the operations homed there: the batch
raises :class:`~porch.errors.PartialStoreError` naming them, and the key pool
answers the others.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ...errors import ConfigurationError, PartialStoreError, StoreError
from ..base import (
    Algorithm,
    Capabilities,
    Claim,
    Hit,
    Lookup,
    Parts,
    Release,
    Settle,
    StoreOp,
    StoreStatistics,
    Vacate,
)
from .homes import counter_home_key, rendezvous, response_home_key

if TYPE_CHECKING:
    from ..admin import StoreAdmin
    from ..base import Claims, PartStore, Store

__all__ = ["ShardedStore"]

logger = logging.getLogger("porch.store.sharded")

# Homes remembered per kind of key (a dict lookup instead of N keyed hashes); past this
# many the memory starts again, so a stream of distinct clients keeps it bounded.
_REMEMBERED = 1 << 16


class ShardedStore:
    """Counters, stored responses and claims over several stores, each key at one home.

    ``stores``: the stores, all of one kind (PostgreSQL or Redis; a SQLite store is one
    host's and is refused), each on a server or schema of its own. Their order does
    not decide where a key lives (each store's secret does: the same for every host,
    whatever URL reaches it), but the first store's secret is this store's
    (:attr:`secret`, what caller scopes are digested with): list the same store first
    on every host, and add servers at the end (docs/stores/sharding.md).

    ``previous``: after servers were added, the stores (of ``stores``) that were there
    before. A stored response whose home moved is then looked up at its old home too,
    until it expires there: a duplicate of a request answered before the change is
    still replayed, not run again. Drop ``previous`` once the longest replay TTL has
    passed since the change.

    Opening opens every store (a server that cannot be reached fails the open; the key
    pool retries); once open, a server that fails gives errors (503) for the keys homed
    there only.
    """

    def __init__(self, stores: Sequence[Store], *, previous: Sequence[Store] = ()) -> None:
        from ..sqlite import SQLiteStore

        children = tuple(stores)
        if not children:
            raise ConfigurationError("a sharded store needs at least one store")
        kind = type(children[0])
        for child in children:
            if isinstance(child, (ShardedStore, SQLiteStore)):
                raise ConfigurationError(
                    "a sharded store holds PostgreSQL or Redis stores, not a"
                    f" {type(child).__name__} (SQLite is one host's store)"
                )
            if type(child) is not kind:
                raise ConfigurationError(
                    "a sharded store's stores must be of one kind, got"
                    f" {kind.__name__} and {type(child).__name__}"
                )
        if len({id(child) for child in children}) != len(children):
            raise ConfigurationError("a sharded store lists the same store twice")
        before = tuple(previous)
        if before and (
            not all(any(p is c for c in children) for p in before)
            or len({id(p) for p in before}) != len(before)
        ):
            raise ConfigurationError(
                "previous must name stores of the sharded store's own, each once"
            )
        self.stores = children
        # Indices (into stores) of the stores there before servers were added.
        self._previous = tuple(next(i for i, c in enumerate(children) if c is p) for p in before)
        self.capabilities = _merge(self, [child.capabilities for child in children])
        self.claims: Claims = _Claims(self)
        self._nodes: tuple[bytes, ...] | None = None
        self._counter_homes: dict[str, int] = {}
        self._response_homes: dict[str, int] = {}
        self._old_homes: dict[str, int] = {}
        # Tokens of hits whose slots were taken on several homes: the token the hit
        # reports -> per home, its own token (what a Vacate of those slots frees).
        self._tokens: dict[tuple[int, tuple[str, ...]], list[tuple[int, int]]] = {}
        self._next_token = itertools.count(1 << 62)
        self._failures = 0

    # -- lifecycle -------------------------------------------------------------------

    async def open(self) -> None:
        if self._nodes is not None:
            return
        results = await asyncio.gather(
            *(child.open() for child in self.stores), return_exceptions=True
        )
        for child, result in zip(self.stores, results, strict=True):
            if isinstance(result, BaseException):
                await self._close_children()
                if isinstance(result, StoreError):
                    raise StoreError(f"a sharded store's {_name(child)}: {result}") from result
                raise result
        nodes = tuple(child.secret for child in self.stores)
        if len(set(nodes)) != len(nodes):
            await self._close_children()
            raise StoreError(
                "a sharded store lists one store twice (two of its stores share their data"
                " and secret: the same server and schema or prefix)"
            )
        self._nodes = nodes

    async def close(self) -> None:
        self._nodes = None
        self._tokens.clear()
        await self._close_children()

    async def _close_children(self) -> None:
        results = await asyncio.gather(
            *(child.close() for child in self.stores), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    @property
    def previous(self) -> tuple[Store, ...]:
        """The stores there before servers were added (``previous``), of :attr:`stores`."""
        return tuple(self.stores[i] for i in self._previous)

    @property
    def secret(self) -> bytes:
        """The first store's secret (see :attr:`porch.store.base.Store.secret`)."""
        if self._nodes is None:
            raise StoreError("the sharded store is not open")
        return self._nodes[0]

    def statistics(self) -> StoreStatistics:
        stats = [child.statistics() for child in self.stores]
        return StoreStatistics(
            sum(s.transactions for s in stats),
            sum(s.operations for s in stats),
            sum(s.failures for s in stats) + self._failures,
        )

    # -- homes -------------------------------------------------------------------------

    def home(self, key: str, *, counter: bool = True) -> int:
        """The index (in :attr:`stores`) of the home of a counter or slot key, or with
        ``counter=False`` of a stored response's scoped key. StoreError before open."""
        nodes = self._nodes
        if nodes is None:
            raise StoreError("the sharded store is not open")
        homes = self._counter_homes if counter else self._response_homes
        found = homes.get(key)
        if found is None:
            if len(homes) >= _REMEMBERED:
                homes.clear()
            found = homes[key] = rendezvous(
                counter_home_key(key) if counter else response_home_key(key), nodes
            )
        return found

    def _old_home(self, key: str) -> int | None:
        """The home a stored response's key had before servers were added, when that is
        another than its home now (None: the same, or no ``previous``)."""
        previous = self._previous
        nodes = self._nodes
        if not previous or nodes is None:
            return None
        found = self._old_homes.get(key)
        if found is None:
            if len(self._old_homes) >= _REMEMBERED:
                self._old_homes.clear()
            old = previous[rendezvous(response_home_key(key), [nodes[i] for i in previous])]
            found = self._old_homes[key] = old
        return None if found == self.home(key, counter=False) else found

    def _route(self, op: StoreOp) -> tuple[tuple[int, ...], Sequence[str]]:
        """An operation's homes, in the order it is decided on them, and its counter keys."""
        if type(op) is Hit:
            keys: Sequence[str] = op.keys if not op.slots else [*op.keys, *op.slots]
        elif type(op) is Settle:
            keys = op.keys
        elif type(op) is Vacate:
            keys = op.slots
        else:
            key: str = op.key  # type: ignore[union-attr]
            return (self.home(key, counter=False),), ()
        if not keys:
            return (0,), keys
        homes: list[int] = []
        for key in keys:
            home = self.home(key)
            if home not in homes:
                homes.append(home)
        return tuple(homes), keys

    # -- applying ----------------------------------------------------------------------

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        """Apply ``ops``, each on its home (or homes, see the module doc); raise
        PartialStoreError naming the operations that failed, if any did."""
        nodes = self._nodes
        if nodes is None:
            raise StoreError("the sharded store is not open")
        if len(nodes) == 1:
            await self.stores[0].apply(ops)
            return
        failed: dict[int, StoreError] = {}
        stage = _Stage(len(nodes))
        for index, op in enumerate(ops):
            homes, keys = self._route(op)
            if not stage.admits(homes, keys):
                await self._run(stage, failed)
                stage = _Stage(len(nodes))
            stage.add(index, op, homes, keys)
        await self._run(stage, failed)
        if self._previous:
            await self._look_back(ops, failed)
        if failed:
            self._failures += 1
            first = failed[min(failed)]
            raise PartialStoreError(
                f"{len(failed)} of {len(ops)} operations failed: {first}", frozenset(failed)
            ) from first

    async def _apply_on(self, home: int, ops: list[StoreOp]) -> StoreError | None:
        """Apply ops on one home; the error it raised, if any (never raised here)."""
        try:
            await self.stores[home].apply(ops)
        except StoreError as exc:
            return exc
        except Exception as exc:  # a bug: logged with its traceback, failed like an error
            logger.exception("porch: a sharded store's %s failed", _name(self.stores[home]))
            return StoreError(repr(exc))
        return None

    async def _run(self, stage: _Stage, failed: dict[int, StoreError]) -> None:
        """Apply one stage: its one-home operations side by side, then its several-home
        ones in rounds (see _Split)."""
        singles = [(home, part) for home, part in enumerate(stage.singles) if part]
        if singles:
            errors = await asyncio.gather(
                *(self._apply_on(home, [op for _, op in part]) for home, part in singles)
            )
            for (_, part), error in zip(singles, errors, strict=True):
                if error is not None:
                    for index, _ in part:
                        failed[index] = error
        if not stage.multi:
            return
        splits = [
            _Split(index, op, homes, self.home, self._tokens) for index, op, homes in stage.multi
        ]
        step = 0
        while True:
            batches: dict[int, list[_Split]] = {}
            for split in splits:
                if split.going and step < len(split.homes):
                    batches.setdefault(split.homes[step], []).append(split)
            if not batches:
                break
            homes = list(batches)
            errors = await asyncio.gather(
                *(self._apply_on(h, [s.parts[step] for s in batches[h]]) for h in homes)
            )
            for home, error in zip(homes, errors, strict=True):
                for split in batches[home]:
                    split.decided(step, error)
            step += 1
        # Give back what refused or failed hits took on the homes that allowed them.
        refunds: dict[int, list[StoreOp]] = {}
        for split in splits:
            for home, op in split.refunds():
                refunds.setdefault(home, []).append(op)
        if refunds:
            homes = list(refunds)
            errors = await asyncio.gather(*(self._apply_on(h, refunds[h]) for h in homes))
            for home, error in zip(homes, errors, strict=True):
                if error is not None:
                    # Units not given back: refusals until their window ends, never more.
                    logger.warning(
                        "porch: a sharded store could not give back units on %s: %s",
                        _name(self.stores[home]),
                        error,
                    )
        for split in splits:
            if split.error is not None:
                failed[split.index] = split.error
            else:
                split.finish(self._tokens, self._next_token)

    async def _look_back(self, ops: Sequence[StoreOp], failed: dict[int, StoreError]) -> None:
        """With ``previous`` stores: a claim taken, or a lookup that found nothing, on a key
        whose home moved is looked up at its old home; a response found there is the
        answer (and the claim taken on the new home is released)."""
        asked: dict[int, list[tuple[int, StoreOp, Lookup]]] = {}
        for index, op in enumerate(ops):
            if index in failed:
                continue
            if (type(op) is Claim and op.token and op.stored is None) or (
                type(op) is Lookup and op.result is None
            ):
                old = self._old_home(op.key)
                if old is not None:
                    asked.setdefault(old, []).append((index, op, Lookup(op.key)))
        if not asked:
            return
        homes = list(asked)
        errors = await asyncio.gather(
            *(self._apply_on(h, [lookup for _, _, lookup in asked[h]]) for h in homes)
        )
        releases: dict[int, list[StoreOp]] = {}
        for home, error in zip(homes, errors, strict=True):
            for index, op, lookup in asked[home]:
                if error is not None:
                    # Unknown whether it was answered before: fail it (the claim lapses).
                    failed[index] = error
                    if type(op) is Claim:
                        releases.setdefault(self.home(op.key, counter=False), []).append(
                            Release(op.key, op.token, scope=op.scope, client=op.client)
                        )
                elif lookup.result is not None:
                    if type(op) is Claim:
                        releases.setdefault(self.home(op.key, counter=False), []).append(
                            Release(op.key, op.token, scope=op.scope, client=op.client)
                        )
                        op.token = 0
                        op.stored = lookup.result
                    elif type(op) is Lookup:
                        op.result = lookup.result
        if releases:
            homes = list(releases)
            errors = await asyncio.gather(*(self._apply_on(h, releases[h]) for h in homes))
            for home, error in zip(homes, errors, strict=True):
                if error is not None:
                    logger.warning("porch: releasing claims on %s failed: %s", home, error)

    def admin(self) -> StoreAdmin:
        """The operator's view of every store at once (``porch inspect|reset|purge|check``)."""
        from .admin import ShardedAdmin

        admins = []
        for child in self.stores:
            make = child.capabilities.admin
            if make is None:  # pragma: no cover - _merge offers admin only when all do
                raise ConfigurationError(f"{type(child).__name__} has no admin protocol")
            admins.append(make())
        return ShardedAdmin(admins)


def _name(store: Store) -> str:
    """How messages name one of the stores (its admin's location: the URL, redacted)."""
    make = store.capabilities.admin
    return type(store).__name__ if make is None else make().location


class _Stage:
    """Operations applied together: the one-home ones first (per home, in order), then
    the several-home ones (see _Split). An operation on a counter a several-home one of
    the stage touched, decided on its homes in another order, starts a new stage: each
    counter sees the batch's operations in their order."""

    __slots__ = ("multi", "routes", "singles")

    def __init__(self, homes: int) -> None:
        self.singles: list[list[tuple[int, StoreOp]]] = [[] for _ in range(homes)]
        self.multi: list[tuple[int, StoreOp, tuple[int, ...]]] = []
        self.routes: dict[str, tuple[int, ...]] = {}

    def admits(self, homes: tuple[int, ...], keys: Sequence[str]) -> bool:
        routes = self.routes
        if not routes:
            return True
        if len(homes) == 1:
            return not any(key in routes for key in keys)
        return all(routes.get(key, homes) == homes for key in keys)

    def add(self, index: int, op: StoreOp, homes: tuple[int, ...], keys: Sequence[str]) -> None:
        if len(homes) == 1:
            self.singles[homes[0]].append((index, op))
            return
        self.multi.append((index, op, homes))
        for key in keys:
            self.routes[key] = homes


class _Split:
    """A hit, settle or vacate whose keys live on several homes, as one part per home.

    A settle's and a vacate's parts never refuse: each is applied on its home. A hit's
    parts are decided one home after another (step i on ``homes[i]``), and it stops at
    the first refusal (or failure); the parts allowed before it are then given back
    (:meth:`refunds`). Only a hit every part of which was allowed is allowed.
    """

    __slots__ = ("error", "going", "homes", "index", "op", "parts", "positions", "refused")

    def __init__(
        self,
        index: int,
        op: StoreOp,
        homes: tuple[int, ...],
        home_of: Callable[[str], int],
        tokens: dict[tuple[int, tuple[str, ...]], list[tuple[int, int]]],
    ) -> None:
        self.index = index
        self.op = op
        self.homes = homes
        self.going = True
        self.refused = False
        self.error: StoreError | None = None
        # Per part: the positions of its keys (and, for a hit, its slots) in the op's lists.
        self.positions: list[tuple[list[int], list[int]]] = []
        self.parts: list[StoreOp] = []
        if type(op) is Hit:
            self._split_hit(op, home_of)
        elif type(op) is Settle:
            for home in homes:
                at = [j for j, key in enumerate(op.keys) if home_of(key) == home]
                self.positions.append((at, []))
                self.parts.append(
                    Settle(
                        [op.keys[j] for j in at],
                        [op.amounts[j] for j in at],
                        [op.windows[j] for j in at],
                        [op.deltas[j] for j in at],
                        [op.stamps[j] for j in at],
                        None if op.algorithms is None else [op.algorithms[j] for j in at],
                        None if op.bursts is None else [op.bursts[j] for j in at],
                    )
                )
        elif type(op) is Vacate:
            # Each home's own token, from the hit that took the slots (ShardedStore._tokens);
            # none known (taken by another process, or freed already): nothing to free.
            own = dict(tokens.pop((op.token, tuple(op.slots)), ()))
            for home in homes:
                at = [j for j, key in enumerate(op.slots) if home_of(key) == home]
                self.positions.append(([], at))
                self.parts.append(
                    Vacate([op.slots[j] for j in at] if home in own else [], own.get(home, 0))
                )

    def _split_hit(self, hit: Hit, home_of: Callable[[str], int]) -> None:
        slots = hit.slots or ()
        for home in self.homes:
            at = [j for j, key in enumerate(hit.keys) if home_of(key) == home]
            slot_at = [j for j, key in enumerate(slots) if home_of(key) == home]
            self.positions.append((at, slot_at))
            algorithms = hit.algorithms
            bursts = hit.bursts
            self.parts.append(
                Hit(
                    [hit.keys[j] for j in at],
                    [hit.amounts[j] for j in at],
                    [hit.windows[j] for j in at],
                    None if algorithms is None else [algorithms[j] for j in at],
                    None if bursts is None else [bursts[j] for j in at],
                    hit.cost,
                    [slots[j] for j in slot_at] if slot_at else None,
                    [hit.caps[j] for j in slot_at],
                )
            )

    def decided(self, step: int, error: StoreError | None) -> None:
        """Part ``step`` was applied (or failed with ``error``)."""
        part = self.parts[step]
        if error is not None:
            self.error = error
            self.going = False
        elif type(part) is Hit and not part.allowed:
            self.refused = True
            self.going = False

    def refunds(self) -> list[tuple[int, StoreOp]]:
        """What a hit that was refused (or failed) gives back on the homes that allowed it."""
        if type(self.op) is not Hit or not (self.refused or self.error is not None):
            return []
        given: list[tuple[int, StoreOp]] = []
        for home, part in zip(self.homes, self.parts, strict=False):
            if type(part) is not Hit or not part.allowed:
                break
            if part.keys and part.cost:
                given.append((home, Settle.of(part, 0)))
            if part.token:
                given.append((home, Vacate.of(part)))
        return given

    def finish(
        self,
        tokens: dict[tuple[int, tuple[str, ...]], list[tuple[int, int]]],
        next_token: itertools.count[int],
    ) -> None:
        """Fill the operation's results from its parts'."""
        op = self.op
        if type(op) is Vacate:
            return
        if type(op) is not Hit:
            return
        n = len(op.keys)
        slots = op.slots or ()
        fits = [True] * n
        remaining = [0] * n
        nexts = [0.0] * n
        fulls = [0.0] * n
        retries = [0.0] * n
        stamps = [0.0] * n
        in_flight = [0] * len(slots)
        wall = 0.0
        allowed = not self.refused
        taken: list[tuple[int, int]] = []
        for home, part, (at, slot_at) in zip(self.homes, self.parts, self.positions, strict=True):
            if type(part) is not Hit:
                continue
            decided = bool(part.remaining) or bool(part.in_flight) or part.allowed
            if not decided:
                # Not asked: the hit was refused on an earlier home. Reported whole.
                for j in at:
                    remaining[j] = _bound(op, j)
                continue
            wall = wall or part.wall
            given_back = allowed is False and part.allowed
            for i, j in enumerate(at):
                fits[j] = part.fits[i]
                left = part.remaining[i]
                # A part given back reports its units as they are again.
                remaining[j] = min(left + op.cost, _bound(op, j)) if given_back else left
                nexts[j] = part.next[i]
                fulls[j] = part.full[i]
                retries[j] = part.retry[i]
                stamps[j] = part.stamp[i]
            for i, j in enumerate(slot_at):
                in_flight[j] = part.in_flight[i] - (1 if given_back and part.token else 0)
            if part.token and not given_back:
                taken.append((home, part.token))
        op.allowed = allowed
        op.fits = fits
        op.remaining = remaining
        op.next = nexts
        op.full = fulls
        op.retry = retries
        op.stamp = stamps
        op.in_flight = in_flight
        op.wall = wall
        if allowed and taken:
            if len(taken) == 1:
                op.token = taken[0][1]
            else:
                op.token = next(next_token)
                tokens[(op.token, tuple(slots))] = taken


def _bound(hit: Hit, j: int) -> int:
    """The most units limit ``j`` of ``hit`` holds (a gcra bucket's burst, else its amount)."""
    algorithms = hit.algorithms
    if algorithms is not None and algorithms[j] == "gcra" and hit.bursts is not None:
        return hit.bursts[j]
    return hit.amounts[j]


class _Claims:
    """Waiting for a claim held elsewhere: on the claim's home (see Claims)."""

    def __init__(self, store: ShardedStore) -> None:
        self._store = store

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        store = self._store
        return store.stores[store.home(key, counter=False)].claims.watch(key, wake, retry_after)


class _Parts:
    """Bodies kept in parts, on their key's home (see PartStore)."""

    def __init__(self, store: ShardedStore, parts: list[PartStore]) -> None:
        self._store = store
        self._parts = parts
        self.part_bytes = parts[0].part_bytes

    def _of(self, key: str) -> PartStore:
        return self._parts[self._store.home(key, counter=False)]

    async def write(self, key: str, body: int, index: int, data: bytes) -> None:
        await self._of(key).write(key, body, index, data)

    async def keep(self, key: str, parts: Parts, ttl: float) -> None:
        await self._of(key).keep(key, parts, ttl)

    async def read(self, key: str, parts: Parts, index: int) -> bytes | None:
        return await self._of(key).read(key, parts, index)

    def drop(self, key: str, body: int) -> None:
        self._of(key).drop(key, body)


def _merge(store: ShardedStore, caps: list[Capabilities]) -> Capabilities:
    """What the stores offer together: what every one of them offers."""
    clock = caps[0].clock
    if any(c.clock is not clock for c in caps):
        raise ConfigurationError("a sharded store's stores must decide on one clock")
    algorithms: frozenset[Algorithm] = frozenset.intersection(*(c.algorithms for c in caps))
    parts: PartStore | None = None
    found = [c.parts for c in caps]
    listed = [p for p in found if p is not None]
    if len(listed) == len(found) and len({p.part_bytes for p in listed}) == 1:
        parts = _Parts(store, listed)
    leases = [c.slot_lease for c in caps if c.slot_lease is not None]
    saves = [c.solo_save_bytes for c in caps if c.solo_save_bytes is not None]
    return Capabilities(
        # Each store's shards send batches side by side; a batch goes to every home.
        shards=max(c.shards for c in caps),
        in_flight=min(c.in_flight for c in caps),
        clock=clock,
        # Nothing committed on the calling task or called back: a batch spans homes.
        apply_then=None,
        apply_now=None,
        solo_save_bytes=min(saves) if len(saves) == len(caps) else None,
        admin=store.admin if all(c.admin is not None for c in caps) else None,
        parts=parts,
        algorithms=algorithms,
        slots=all(c.slots for c in caps),
        slot_lease=max(leases) if leases else None,
    )
