"""Where a key lives among several stores: rendezvous hashing over a stable hash.

Each store is a *node*, named by bytes every host reads alike (a store's
:attr:`~porch.store.base.Store.secret`, created once with its schema: the same
whatever URL a host reaches it by). A key's home is the node whose keyed
blake2b of the key scores highest (highest random weight, Thaler and Ravishankar
1996): every host computes it alone, no table is shared, and a node added takes
from each other node only the keys it now wins, about 1/N of them; a node
removed gives its keys away and moves nothing else.

What is hashed is a key's *home key*, so that keys decided together share a home:

- a counter or slot key ``rl US rule US limit US client`` without its limit's name:
  every limit and concurrency cap of one rule and one client (or organisation, or
  everyone) lives on one home, so a one-level rule is decided in one store step;
- a stored response's key ``scope US key`` without its key: every response of one
  caller scope (or idempotent function) lives on one home, so a scope's quota is
  counted in one place, exactly.

Any other key is hashed whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

__all__ = ["counter_home_key", "rendezvous", "response_home_key"]

US = "\x1f"


def counter_home_key(key: str) -> str:
    """What decides the home of a counter or slot key (see the module doc)."""
    if key.startswith("rl\x1f"):
        parts = key.split(US, 3)
        if len(parts) == 4:
            return f"rl{US}{parts[1]}{US}{parts[3]}"
    return key


def response_home_key(key: str) -> str:
    """What decides the home of a stored response's scoped key (see the module doc)."""
    cut = key.rfind(US)
    return key if cut < 0 else key[:cut]


def rendezvous(home_key: str, nodes: Sequence[bytes]) -> int:
    """The index in ``nodes`` of ``home_key``'s home: the highest keyed blake2b score
    (a tie, 2^-64 likely, goes to the lower index)."""
    data = home_key.encode("utf-8", "surrogatepass")
    best = 0
    top = b""
    for index, node in enumerate(nodes):
        score = blake2b(data, digest_size=8, key=node[:64]).digest()
        if score > top:
            best, top = index, score
    return best
