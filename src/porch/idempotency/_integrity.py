"""Stored responses that cannot be forged by whoever can write to the store (opt-in).

Anyone with write access to a shared store could otherwise put any response,
``Location`` included, under any caller's key, and porch would replay it. With
``IdempotencyMiddleware(integrity_key=...)`` (a secret the store never sees), the
owner's response is stored with an HMAC-SHA256 over its scoped key (so a record
cannot be moved to another key or caller), request digest, status, replayed
headers and body; a replay checks it first, and a record that fails is not
replayed. The MAC travels in the stored head as the pseudo-header ``porch-mac``,
which no handler's response can carry into the store (only ``REPLAYED_HEADERS``
are stored) and a replay never sends.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from ..errors import ConfigurationError
from ..store.base import StoredResponse

__all__ = ["MAC_HEADER", "MAC_SIZE", "IntegrityKeys"]

MAC_HEADER = b"porch-mac"
# What the MAC adds to a stored response's size (its pseudo-header, hex).
MAC_SIZE = len(MAC_HEADER) + 2 * hashlib.sha256().digest_size
_MIN_KEY = 16


class IntegrityKeys:
    """The keys stored responses are signed with (the first) and checked against (any: the
    earlier ones stay readable while a new key rolls out)."""

    __slots__ = ("_keys",)

    def __init__(self, keys: bytes | Sequence[bytes]) -> None:
        found = (keys,) if isinstance(keys, bytes | bytearray) else tuple(keys)
        if not found:
            raise ConfigurationError("integrity_key needs at least one key")
        for key in found:
            if not isinstance(key, bytes | bytearray) or len(key) < _MIN_KEY:
                raise ConfigurationError(
                    f"an integrity_key must be at least {_MIN_KEY} random bytes"
                )
        self._keys = tuple(bytes(key) for key in found)

    def sign(self, key: str, response: StoredResponse) -> StoredResponse:
        """``response`` with its MAC among its headers, as it is stored."""
        mac = _mac(self._keys[0], key, response).hex().encode("ascii")
        return StoredResponse(
            response.digest, response.status, (*response.headers, (MAC_HEADER, mac)), response.body
        )

    def verify(self, key: str, stored: StoredResponse) -> bool:
        """Whether ``stored`` carries a MAC of this key's response under one of the keys."""
        macs = [value for name, value in stored.headers if name == MAC_HEADER]
        if len(macs) != 1:
            return False
        try:
            found = bytes.fromhex(macs[0].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return False
        headers = tuple(pair for pair in stored.headers if pair[0] != MAC_HEADER)
        unsigned = StoredResponse(stored.digest, stored.status, headers, stored.body)
        return any(hmac.compare_digest(_mac(k, key, unsigned), found) for k in self._keys)


def _mac(secret: bytes, key: str, response: StoredResponse) -> bytes:
    # Every part length-prefixed: no two different records run together into one input.
    scoped = key.encode("utf-8", "surrogatepass")
    h = hmac.new(secret, digestmod=hashlib.sha256)
    h.update(
        b"%d:%s%d:%s%d;"
        % (len(scoped), scoped, len(response.digest), response.digest, response.status)
    )
    h.update(b"%d;" % len(response.headers))
    for name, value in response.headers:
        h.update(b"%d:%s%d:%s" % (len(name), name, len(value), value))
    h.update(b"%d:" % len(response.body))
    h.update(response.body)
    return h.digest()
