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
"""

from __future__ import annotations

import hashlib

__all__ = ["KeyNames"]

_US = "\x1f"  # porch's field separator inside its logical keys


def _tag(text: str) -> str:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return "{" + digest + "}"


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class KeyNames:
    """The Redis names of porch's logical keys under one prefix."""

    __slots__ = ("channel", "prefix", "secret", "total_sizes", "total_zset")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        # Save/Release publish the logical key here; each process subscribes once.
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
        parts = key.split(_US, 3)
        source = parts[1] + _US + parts[3] if len(parts) == 4 and parts[0] == "rl" else key
        return _encode(f"{self.prefix}:k:{_tag(source)}:{key}")

    def slot(self, key: str) -> bytes:
        # A concurrency cap's key has a counter key's form: the same tag as the rule's
        # counters of that level (``:s:``, a sorted set of the requests in flight).
        parts = key.split(_US, 3)
        source = parts[1] + _US + parts[3] if len(parts) == 4 and parts[0] == "rl" else key
        return _encode(f"{self.prefix}:s:{_tag(source)}:{key}")

    def record(self, key: str) -> bytes:
        # porch's idempotency keys are scope US key: tag by scope, like its quota.
        return _encode(f"{self.prefix}:r:{_tag(key.split(_US, 1)[0])}:{key}")

    def body(self, key: str, body: int) -> bytes:
        """A body streamed in parts (a hash of part index -> bytes), in its record's slot."""
        return _encode(f"{self.prefix}:p:{_tag(key.split(_US, 1)[0])}:{key}{_US}{body}")

    def scope(self, scope: str) -> tuple[bytes, bytes]:
        tag = _tag(scope)
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
