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

A body streamed to the store in parts is never whole in memory: its MAC is computed
as it passes (:class:`BodyMac`), over the same head, then the body, then its length
(known only at its end): a ``*`` where a whole body's length would stand keeps the
two kinds of input apart, so a record of one kind never verifies as the other.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from ..errors import ConfigurationError
from ..store.base import StoredResponse

__all__ = ["MAC_HEADER", "MAC_SIZE", "BodyMac", "IntegrityKeys"]

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
        """Whether ``stored`` carries a MAC of this key's response under one of the keys
        (a body in parts never does here: see :meth:`check`)."""
        found = _found(stored)
        if found is None or stored.parts is not None:
            return False
        headers = tuple(pair for pair in stored.headers if pair[0] != MAC_HEADER)
        unsigned = StoredResponse(stored.digest, stored.status, headers, stored.body)
        return any(hmac.compare_digest(_mac(k, key, unsigned), found) for k in self._keys)

    def streaming(
        self, key: str, digest: bytes, status: int, headers: tuple[tuple[bytes, bytes], ...]
    ) -> BodyMac:
        """The MAC of a response whose body is about to stream, signed with the first key."""
        return BodyMac(self._keys[:1], key, digest, status, headers)

    def header(self, mac: BodyMac, length: int) -> tuple[bytes, bytes]:
        """The stored pseudo-header of a streamed body's ``mac`` once its ``length`` bytes
        passed."""
        return MAC_HEADER, mac.digests(length)[0].hex().encode("ascii")

    def check(self, key: str, stored: StoredResponse) -> BodyCheck | None:
        """A check of ``stored``'s body in parts, to feed as it is read; None if its head
        carries no MAC at all (it cannot verify)."""
        found = _found(stored)
        if found is None or stored.parts is None:
            return None
        headers = tuple(pair for pair in stored.headers if pair[0] != MAC_HEADER)
        mac = BodyMac(self._keys, key, stored.digest, stored.status, headers)
        return BodyCheck(mac, found, stored.parts.length)


class BodyMac:
    """The MACs (one per key) of a response whose body streams: its head first, then each
    piece of the body as it passes (:meth:`update`), then its length (:meth:`digests`)."""

    __slots__ = ("_macs",)

    def __init__(
        self,
        secrets: Sequence[bytes],
        key: str,
        digest: bytes,
        status: int,
        headers: tuple[tuple[bytes, bytes], ...],
    ) -> None:
        self._macs = [_head(secret, key, digest, status, headers) for secret in secrets]
        for mac in self._macs:
            mac.update(b"*")  # where a whole body's length stands: another kind of input

    def update(self, data: bytes) -> None:
        for mac in self._macs:
            mac.update(data)

    def digests(self, length: int) -> list[bytes]:
        """Each key's MAC, the body having been ``length`` bytes (this object goes on)."""
        found = []
        for mac in self._macs:
            done = mac.copy()
            done.update(b"*%d" % length)
            found.append(done.digest())
        return found


class BodyCheck:
    """A streamed body's MAC checked against the one stored: :meth:`update` with every
    part read, then :meth:`verified`."""

    __slots__ = ("_found", "_length", "_mac", "_seen")

    def __init__(self, mac: BodyMac, found: bytes, length: int) -> None:
        self._mac = mac
        self._found = found
        self._length = length
        self._seen = 0

    def update(self, data: bytes) -> None:
        self._seen += len(data)
        self._mac.update(data)

    def verified(self) -> bool:
        """Whether the body read so far is the whole body the stored MAC signs."""
        if self._seen != self._length:
            return False
        return any(hmac.compare_digest(mac, self._found) for mac in self._mac.digests(self._seen))


def _found(stored: StoredResponse) -> bytes | None:
    """The MAC a stored head carries, or None (none, several, or not hex)."""
    macs = [value for name, value in stored.headers if name == MAC_HEADER]
    if len(macs) != 1:
        return None
    try:
        return bytes.fromhex(macs[0].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def _head(
    secret: bytes, key: str, digest: bytes, status: int, headers: tuple[tuple[bytes, bytes], ...]
) -> hmac.HMAC:
    # Every part length-prefixed: no two different records run together into one input.
    scoped = key.encode("utf-8", "surrogatepass")
    h = hmac.new(secret, digestmod=hashlib.sha256)
    h.update(b"%d:%s%d:%s%d;" % (len(scoped), scoped, len(digest), digest, status))
    h.update(b"%d;" % len(headers))
    for name, value in headers:
        h.update(b"%d:%s%d:%s" % (len(name), name, len(value), value))
    return h


def _mac(secret: bytes, key: str, response: StoredResponse) -> bytes:
    h = _head(secret, key, response.digest, response.status, response.headers)
    h.update(b"%d:" % len(response.body))
    h.update(response.body)
    return h.digest()
