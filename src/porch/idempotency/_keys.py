"""Parsing the ``Idempotency-Key`` header, and scoping keys to their caller."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from .._types import Scope
from ..errors import ConfigurationError, UnidentifiedCallerError
from ..identity import UNKNOWN_CLIENT, ClientIdentity

__all__ = [
    "SECRET",
    "CallerScope",
    "InvalidKey",
    "ScopeFunc",
    "authorization_scope",
    "parse_key",
    "request_digest",
    "scope_digest",
    "store_secret",
]

ScopeFunc = Callable[[Scope], str]

MAX_KEY_LENGTH = 255


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
    # ASCII first, then printable: for ASCII text str.isprintable() is exactly
    # 0x20-0x7e, and these two C calls cost half of a regex match.
    if key.isascii():
        text = key.decode("ascii")
        if text.isprintable():
            return text
    raise InvalidKey("Idempotency-Key must be printable ASCII")


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


# Where IdempotencyMiddleware hands its store's secret (Store.secret) to the caller-scope
# function: a key of a copy of the request's scope, made for that call (the app never
# sees it). The digests of credentials are keyed with it.
SECRET = "porch.scope_secret"


def store_secret(scope: Scope) -> bytes:
    """The store's secret the middleware put in ``scope``, to key a digest of credentials.

    Raises ConfigurationError outside the middleware: an unkeyed digest of a
    password could be tested against a dictionary by whoever sees it.
    """
    try:
        secret: bytes = scope[SECRET]
    except KeyError:
        raise ConfigurationError(
            "a digest of credentials is keyed with the store's secret: call this scope"
            " function through IdempotencyMiddleware(scope=...)"
        ) from None
    return secret


def authorization_scope(scope: Scope) -> str:
    """A caller scope from ``Authorization`` alone (or ``anon``): a digest keyed with the
    store's secret (see :func:`store_secret`).

    Not the default: every caller without the header shares the ``anon`` scope,
    so they can replay and probe each other's keys. Use it only where every
    request to an idempotent route carries ``Authorization``.
    """
    auth = [v for k, v in scope["headers"] if k == b"authorization"]
    if not auth:
        return "anon"
    return hashlib.blake2b(b"\n".join(auth), digest_size=16, key=store_secret(scope)).hexdigest()


class CallerScope:
    """The default caller scope: who a key belongs to, so no caller sees another's keys.

    A request carrying ``Authorization`` or ``Cookie`` is scoped by a digest of
    both (a new token or session is a new caller), keyed with the store's secret
    (:func:`store_secret`): a scope shown by ``porch inspect`` or a log line cannot
    be tested against a dictionary of passwords without the store. A request carrying neither
    is scoped by its client identity — ``identity`` (default:
    :class:`ClientIdentity`, the peer host), which should be the key function
    the rate limiter uses. So an anonymous client whose address changes (a new
    NAT mapping, another /64) gets a fresh scope, and its retry runs the handler
    again: pass ``scope=`` a function returning your user id to do better.

    A request with neither credentials nor a client address (a unix-socket proxy
    not named in ``trusted_proxies``, a WSGI server without ``REMOTE_ADDR``) has no
    scope of its own: every such caller would share one. It raises
    :class:`~porch.errors.UnidentifiedCallerError` instead, and the middleware
    refuses the keyed request.
    """

    __slots__ = ("_identity",)

    def __init__(self, *, identity: Callable[[Scope], str] | None = None) -> None:
        self._identity: Callable[[Scope], str] = (
            identity if identity is not None else ClientIdentity()
        )

    @property
    def identity(self) -> Callable[[Scope], str]:
        """The client identity an anonymous caller is scoped by (and quotas count under)."""
        return self._identity

    def __call__(self, scope: Scope) -> str:
        h: hashlib.blake2b | None = None
        for name, value in scope["headers"]:
            if name == b"authorization" or name == b"cookie":
                if h is None:
                    h = hashlib.blake2b(digest_size=16, key=store_secret(scope))
                # Length-prefixed and labelled: "Cookie: x" is not "Authorization: x".
                h.update(b"%s %d:" % (name[:1], len(value)))
                h.update(value)
        if h is not None:
            return "cred:" + h.hexdigest()
        client = self._identity(scope)
        if not client or client == UNKNOWN_CLIENT:
            raise UnidentifiedCallerError("the request has no credentials and no client address")
        return "client:" + client


def request_digest(
    method: str,
    path: str,
    query: bytes,
    body: bytes,
    headers: Sequence[tuple[bytes, Sequence[bytes]]] = (),
) -> bytes:
    """What makes two requests "the same": method, path with query, the named headers, body.

    ``headers`` pairs a lower-case header name with the values the request sent
    for it (none: absent). Every part is length-prefixed, so no two different
    requests can be made to run together into one digest.
    """
    return _digest(method, path, query, body, b"".join([_framed(n, vs) for n, vs in headers]))


def scope_digest(scope: Scope, body: bytes, names: Sequence[bytes]) -> bytes:
    """:func:`request_digest` of an ASGI request, ``names`` the rule's digest headers."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    if len(names) == 1:  # the usual rule (Content-Type alone): no list of pairs to build
        name = names[0]
        framed = _framed(name, [v for k, v in headers if k == name])
    else:
        framed = b"".join([_framed(n, [v for k, v in headers if k == n]) for n in names])
    return _digest(scope["method"], scope["path"], scope.get("query_string", b""), body, framed)


def _framed(name: bytes, values: Sequence[bytes]) -> bytes:
    """One digest header's part: its name, how many values it had, each value."""
    if len(values) == 1:  # sent once, the usual: one format call
        return b"h%d:%s#1%d:%s" % (len(name), name, len(values[0]), values[0])
    return b"h%d:%s#%d" % (len(name), name, len(values)) + b"".join(
        [b"%d:%s" % (len(value), value) for value in values]
    )


def _digest(method: str, path: str, query: bytes, body: bytes, framed: bytes) -> bytes:
    # The same byte stream as hashing each piece in turn, the small pieces formatted in
    # one call (two hash calls, not a dozen; the body is never copied).
    method_b = method.upper().encode("ascii", "replace")
    path_b = path.encode("utf-8", "surrogateescape")
    h = hashlib.blake2b(
        b"%d:%s%d:%s%d:%s%sb%d:"
        % (len(method_b), method_b, len(path_b), path_b, len(query), query, framed, len(body)),
        digest_size=32,
    )
    h.update(body)
    return h.digest()
