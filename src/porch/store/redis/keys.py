"""Where porch keeps things in Redis: key names with hash tags that keep each op in one slot.

Keys that one script call touches share a hash tag where they can, so such a
call runs on one node of a Redis Cluster: a rule's counters of one level key
are tagged by rule and that key (the caller's limits, decided together), an
idempotency record and its caller's quota bookkeeping by the caller's scope.
A rule counting at several levels (the caller, an organisation, everyone)
touches counters of several tags in one call, which a standalone server runs
atomically and a Cluster would refuse (CROSSSLOT): see docs/design.md, "Redis".
The tag is a short digest, so a caller name holding ``{`` or ``}`` cannot move
a key to another slot.

On a Redis Cluster (``cluster=True``) a record's tag is one of ``WAKE_TAGS``
buckets of scopes, not the scope's own digest: the Save and Release scripts
``SPUBLISH`` on a wake channel of the record's slot, and a process subscribes
to every channel once, so their number must be bounded. Its quota bookkeeping
entries in the client's and the store's books (other slots) are named by the
record and the claim's token (:meth:`KeyNames.book_member`), so a step
undoing one claim's entry never touches another claim's on the same record.
"""

from __future__ import annotations

import hashlib

__all__ = ["WAKE_TAGS", "KeyNames"]

_US = "\x1f"  # porch's field separator inside its logical keys
WAKE_TAGS = 512
"""The records' hash tags on a Redis Cluster (each with its wake channel, all subscribed)."""


def _tag(text: str) -> str:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return "{" + digest + "}"


def _bucket(text: str) -> str:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return "{w" + str(int.from_bytes(digest, "big") % WAKE_TAGS) + "}"


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class KeyNames:
    """The Redis names of porch's logical keys under one prefix."""

    __slots__ = ("channel", "cluster", "prefix", "secret", "total_sizes", "total_zset")

    def __init__(self, prefix: str, *, cluster: bool = False) -> None:
        self.prefix = prefix
        self.cluster = cluster
        # Save/Release publish the logical key here; each process subscribes once. (On a
        # Cluster: on the record's own wake channel, ``wake``.)
        self.channel = _encode(f"{prefix}:wake")
        # The store's secret (Store.secret): a string of 32 random bytes, no TTL.
        self.secret = _encode(f"{prefix}:secret")
        # The store-wide byte total is one key pair (outside any caller's slot).
        self.total_zset = _encode(f"{prefix}:qz:{{total}}")
        self.total_sizes = _encode(f"{prefix}:qb:{{total}}")

    def counter(self, key: str) -> bytes:
        # porch's counter keys are rl US rule US limit US level key (the caller's, an
        # organisation's, everyone's ''): tag by rule and level key, so a rule's limits
        # of one level share a slot. (``:k:``, hashes; the strings of releases before the
        # policies were ``:c:``, so hosts of both never meet on one key.)
        return _encode(f"{self.prefix}:k:{self.counter_tag(key)}:{key}")

    def slot(self, key: str) -> bytes:
        # A concurrency cap's key has a counter key's form: the same tag as the rule's
        # counters of that level (``:s:``, a sorted set of the requests in flight).
        return _encode(f"{self.prefix}:s:{self.counter_tag(key)}:{key}")

    def counter_tag(self, key: str) -> str:
        """The hash tag of a counter's (or a slot key's) Redis name: what decides its slot."""
        parts = key.split(_US, 3)
        return _tag(parts[1] + _US + parts[3] if len(parts) == 4 and parts[0] == "rl" else key)

    def _scope_tag(self, scope: str) -> str:
        return _bucket(scope) if self.cluster else _tag(scope)

    def record(self, key: str) -> bytes:
        # porch's idempotency keys are scope US key: tag by scope, like its quota.
        return _encode(f"{self.prefix}:r:{self._scope_tag(key.split(_US, 1)[0])}:{key}")

    def wake(self, key: str) -> bytes:
        """The channel a Cluster's Save and Release of ``key`` publish on: in its record's slot."""
        return self.wake_channel(self._scope_tag(key.split(_US, 1)[0]))

    def wake_channel(self, tag: str) -> bytes:
        return _encode(f"{self.prefix}:wake:{tag}")

    def wake_channels(self) -> list[bytes]:
        """Every wake channel of a Cluster store (one per record tag)."""
        return [self.wake_channel("{w" + str(i) + "}") for i in range(WAKE_TAGS)]

    def same_slot(self, key: str, scope: str) -> bool:
        """Whether the record of ``key`` and the quota book of ``scope`` share a tag (they
        do when ``key`` is ``scope`` US its own name, as porch's keys are)."""
        return self._scope_tag(key.split(_US, 1)[0]) == self._scope_tag(scope)

    def book_member(self, key: str, token: int | str) -> bytes:
        """A Cluster claim's (or stored response's) entry in its client's and the store's
        quota books: its record's name and the claim's token."""
        return self.record(key) + _US.encode() + str(token).encode()

    def body(self, key: str, body: int) -> bytes:
        """A body streamed in parts (a hash of part index -> bytes), in its record's slot."""
        tag = self._scope_tag(key.split(_US, 1)[0])
        return _encode(f"{self.prefix}:p:{tag}:{key}{_US}{body}")

    def scope(self, scope: str) -> tuple[bytes, bytes]:
        tag = self._scope_tag(scope)
        return (
            _encode(f"{self.prefix}:qz:{tag}:{scope}"),
            _encode(f"{self.prefix}:qb:{tag}:{scope}"),
        )

    def client(self, client: str) -> tuple[bytes, bytes]:
        """A client identity's quota bookkeeping (a slot of its own: any scope it uses)."""
        tag = _tag(client)
        return (
            _encode(f"{self.prefix}:qcz:{tag}:{client}"),
            _encode(f"{self.prefix}:qcb:{tag}:{client}"),
        )

    def buckets(self, key: str, scope: str, client: str) -> list[bytes]:
        """The record of ``key`` and the quota bookkeeping of its scope, client and the
        whole store, as the claim, save and release scripts take them."""
        return [
            self.record(key),
            *self.scope(scope),
            *self.client(client),
            self.total_zset,
            self.total_sizes,
        ]
