"""Which client a request comes from: the key the rate limiter counts under.

By default the key is the connection's peer host and forwarding headers are
ignored, because anyone can send them. Behind proxies, name them, either by
count (``trust_hops``) or by network (``trusted_proxies``; ``"unix"`` names a
proxy on a unix socket), and the key is the address the nearest untrusted hop
was seen from.

Forwarding headers are read from the right, and only as far as the trusted
proxies wrote them: whatever a client put further left is never read, so
padding or garbage there changes nothing (it can neither pick a key nor push a
client onto the proxy's). An entry that is read was written by a trusted proxy;
if it cannot be read (not an address, over ``max_header_bytes``, more than
``max_hops`` trusted hops), identifying the client fails with
:class:`ForwardingHeaderError` and the middleware answers 400 — never a key
the client chose or shares with the proxy.

IPv6 clients are keyed by their /64 (``ipv6_prefix``), since one host commonly
holds a whole /64; NAT64 addresses (``64:ff9b::/96``) by the IPv4 they embed.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Literal

from ._types import Scope
from .errors import ConfigurationError, ForwardingHeaderError

__all__ = ["UNKNOWN_CLIENT", "ClientIdentity", "KeyFunc"]

#: The client key of a request: a callable given the ASGI scope, returning the key, or an
#: awaitable of it (an async function: an API key looked up in a database). It may read what
#: the app's authentication, running before porch, left in the scope (``scope["state"]``,
#: ``scope["user"]``); it may raise ForwardingHeaderError for a 400.
KeyFunc = Callable[[Scope], str | Awaitable[str]]

_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_log = logging.getLogger("porch.identity")

_HEADERS = ("x-forwarded-for", "forwarded")
# The key of a request without a client address (a unix socket, a WSGI server without
# REMOTE_ADDR): every such request shares it.
UNKNOWN_CLIENT = _UNKNOWN = "unknown"
_UNIX = "unix"
# The well-known NAT64 prefix (RFC 6052): the client is the IPv4 in the last 32 bits.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# One RFC 7239 forwarded-pair (token "=" token / quoted-string) and what ends it.
_PAIR = re.compile(r'([^=;"]*)(?:=[ \t]*("(?:[^"\\]|\\.)*"|[^;"]*))?[ \t]*(;|\Z)', re.DOTALL)
_ESCAPED = re.compile(r"\\(.)", re.DOTALL)
# Enough of a bad entry to recognise it; the rest could be kilobytes of text.
_SHOW_CHARS = 64


class ClientIdentity:
    """Finds the client key of an ASGI request: the peer host, or the client named by trusted
    proxies.

    ``trust_hops``: how many proxies in front of the app append to the header (the
    peer is the nearest). ``trusted_proxies``: the networks proxies connect from,
    and ``"unix"`` for a proxy connecting over a unix socket (no peer address).
    ``max_hops`` bounds how many trusted entries are walked and ``max_header_bytes``
    the bytes of the entries read. ``ipv6_prefix`` groups IPv6 clients (128: one
    key per address).
    """

    __slots__ = (
        "_checked",
        "_header",
        "_header_name",
        "_ipv6_shift",
        "_max_header_bytes",
        "_max_hops",
        "_prefix",
        "_trust_hops",
        "_trust_unix",
        "_trusted",
        "_walks",
    )

    _checked: list[bool]
    _header: str
    _header_name: bytes
    _ipv6_shift: int
    _max_header_bytes: int
    _max_hops: int
    _prefix: int
    _trust_hops: int
    _trust_unix: bool
    _trusted: tuple[_IPNetwork, ...]
    _walks: bool

    def __init__(
        self,
        *,
        trust_hops: int = 0,
        trusted_proxies: Sequence[str] = (),
        header: Literal["x-forwarded-for", "forwarded"] = "x-forwarded-for",
        ipv6_prefix: int = 64,
        max_header_bytes: int = 4096,
        max_hops: int = 32,
    ) -> None:
        if trust_hops < 0:
            raise ConfigurationError(f"trust_hops must be >= 0, got {trust_hops}")
        # A bare string is a sequence of one-character "networks"; say what was meant.
        if isinstance(trusted_proxies, str):
            raise ConfigurationError("trusted_proxies must be a sequence of strings, not a string")
        if trust_hops > 0 and trusted_proxies:
            raise ConfigurationError("set trust_hops or trusted_proxies, not both")
        if header not in _HEADERS:
            raise ConfigurationError(
                f"header must be 'x-forwarded-for' or 'forwarded', got {header!r}"
            )
        if isinstance(ipv6_prefix, bool) or not 1 <= ipv6_prefix <= 128:
            raise ConfigurationError(f"ipv6_prefix must be 1-128, got {ipv6_prefix}")
        if max_header_bytes < 1:
            raise ConfigurationError(f"max_header_bytes must be >= 1, got {max_header_bytes}")
        if max_hops < 1:
            raise ConfigurationError(f"max_hops must be >= 1, got {max_hops}")
        trusted: list[_IPNetwork] = []
        trust_unix = False
        for entry in trusted_proxies:
            if entry.strip().lower() == _UNIX:
                trust_unix = True
                continue
            try:
                trusted.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                raise ConfigurationError(
                    f"trusted_proxies entry {entry!r} is not an IP address or network, or 'unix'"
                ) from None
        init = object.__setattr__
        init(self, "_trust_hops", trust_hops)
        init(self, "_trusted", tuple(trusted))
        init(self, "_trust_unix", trust_unix)
        init(self, "_walks", trust_hops > 0 or bool(trusted) or trust_unix)
        init(self, "_header", header)
        init(self, "_header_name", header.encode("ascii"))
        init(self, "_prefix", ipv6_prefix)
        init(self, "_ipv6_shift", 128 - ipv6_prefix)
        init(self, "_max_header_bytes", max_header_bytes)
        init(self, "_max_hops", max_hops)
        # Whether the exposure of a trust_hops server was checked (once, on the first request).
        init(self, "_checked", [trust_hops == 0])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __call__(self, scope: Scope) -> str:
        """The client key; raises ForwardingHeaderError if a trusted entry cannot be read."""
        if self._walks:
            if not self._checked[0]:
                self._check_exposure(scope)
            return self._forwarded_key(scope)
        # The hot path: an IPv4 peer is used as the server reports it, unparsed.
        client = scope.get("client")
        if client is None:
            return _UNKNOWN
        host: str = client[0]
        if ":" in host:
            return self._peer_key(host)
        return host or _UNKNOWN

    def _check_exposure(self, scope: Scope) -> None:
        self._checked[0] = True
        # The address this connection reached the server on. A server listening on
        # every address but reached over loopback by its proxy is not caught here.
        server = scope.get("server")
        host = server[0] if server else None
        ip = _parse_ip(host) if isinstance(host, str) else None
        if ip is not None and not ip.is_loopback:
            _log.warning(
                "trust_hops=%d trusts whoever connects, and this server is reachable on %s: "
                "a client connecting directly names its own key in %s. Name the proxies with "
                "trusted_proxies, or listen on loopback or a unix socket",
                self._trust_hops,
                ip,
                self._header,
            )

    def _forwarded_key(self, scope: Scope) -> str:
        client = scope.get("client")
        peer: str | None = None if client is None else client[0]
        if self._trust_hops:
            return self._walk_hops(scope, peer)
        return self._walk_trusted(scope, peer)

    def _walk_hops(self, scope: Scope, peer: str | None) -> str:
        # The client is the entry trust_hops from the right (the leftmost there is, if the
        # chain is shorter); the entries between it and the peer are proxies.
        entries = list(itertools.islice(self._from_right(scope), self._trust_hops))
        if not entries:
            return self._peer_key(peer)
        return self._key(self._parse(entries[-1], len(entries)))

    def _walk_trusted(self, scope: Scope, peer: str | None) -> str:
        ip: _IPAddress | None = None
        if not peer:
            # No peer address: a unix socket, trusted only when named.
            if not self._trust_unix:
                return _UNKNOWN
        else:
            ip = _parse_ip(peer)
            # An untrusted peer wrote the headers itself: they mean nothing.
            if ip is None or not self._is_trusted(ip):
                return self._peer_key(peer)
        for hop, entry in enumerate(self._from_right(scope), start=1):
            if hop > self._max_hops:
                raise ForwardingHeaderError(
                    f"the {self._header} header has more than max_hops={self._max_hops} "
                    "trusted hops"
                )
            ip = self._parse(entry, hop)
            if not self._is_trusted(ip):
                return self._key(ip)
        return _UNKNOWN if ip is None else self._key(ip)

    def _is_trusted(self, ip: _IPAddress) -> bool:
        # Cross-version membership is simply False, so one list serves both families.
        return any(ip in network for network in self._trusted)

    def _from_right(self, scope: Scope) -> Iterator[str]:
        """The header's hops, right to left, unparsed, split off only as far as they are read.

        The text left of what a walk reads (a client's) is neither split nor counted
        against the limits. ``Forwarded`` elements are split on the commas outside
        quoted strings (RFC 7239: a proxy may quote client text, commas and all, in a
        parameter), found from the right: a client's unbalanced quote further left
        cannot change where the proxy-written elements end.
        """
        values = [value for name, value in scope.get("headers", ()) if name == self._header_name]
        quoted = self._header == "forwarded"
        budget = self._max_header_bytes + 1
        size = 0
        for value in reversed(values):
            end = len(value)
            while True:
                if quoted:
                    start = _element_start(value, end, budget - size)
                else:
                    start = value.rfind(b",", 0, end) + 1
                size += end - start + 1
                if start < 0 or size > budget:
                    raise ForwardingHeaderError(
                        f"the trusted entries of the {self._header} header are over "
                        f"max_header_bytes={self._max_header_bytes}"
                    )
                yield value[start:end].decode("latin-1")
                if start == 0:
                    break
                end = start - 1

    def _parse(self, entry: str, hop: int) -> _IPAddress:
        """The address in one entry; ``hop`` counts from the right, for the message."""
        node = _for_node(entry, hop) if self._header == "forwarded" else entry.strip()
        ip = _parse_ip(_strip_port(node))
        if ip is None:
            raise ForwardingHeaderError(
                f"hop {hop} from the right of the {self._header} header is not an IP address: "
                f"{_show(node)}"
            )
        return ip

    def _peer_key(self, peer: str | None) -> str:
        if not peer:
            return _UNKNOWN
        ip = _parse_ip(peer)
        # Not every peer is an address (a unix socket path, a test client's name).
        return peer if ip is None else self._key(ip)

    def _key(self, ip: _IPAddress) -> str:
        if ip.version == 6:
            if ip in _NAT64:
                # A NAT64 gateway: the client is the IPv4 host embedded in the address.
                return str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
            if self._ipv6_shift:
                shift = self._ipv6_shift
                return str(ipaddress.IPv6Network((int(ip) >> shift << shift, self._prefix)))
        return str(ip)


def _parse_ip(text: str) -> _IPAddress | None:
    """``text`` as an address, IPv4-mapped IPv6 unwrapped; None if it is not one."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        # A dual-stack socket shows IPv4 clients as ::ffff:a.b.c.d; one client, one key.
        return ip.ipv4_mapped
    return ip


def _element_start(value: bytes, end: int, budget: int) -> int:
    """Where the ``Forwarded`` element ending at ``end`` starts: after the nearest comma
    to its left outside a quoted string. -1 when it would be longer than ``budget``.

    Scanned right to left: a quote counts unless an odd number of backslashes
    precedes it (``\\"`` is an escaped backslash, then the closing quote).
    """
    inside = False
    i = end - 1
    stop = max(end - budget - 1, -1)
    while i > stop:
        c = value[i]
        if c == 0x22:  # '"'
            j = i - 1
            while j >= 0 and value[j] == 0x5C:  # '\\'
                j -= 1
            if (i - 1 - j) % 2 == 0:
                inside = not inside
        elif c == 0x2C and not inside:  # ','
            return i + 1
        i -= 1
    return 0 if i < 0 else -1


def _pairs(element: str, hop: int) -> Iterator[tuple[str, str]]:
    """The ``name=value`` pairs of one RFC 7239 element, split on the semicolons outside
    quoted strings, a quoted value unquoted (``\\x`` is ``x``); empty pairs are skipped."""
    pos = 0
    while True:
        match = _PAIR.match(element, pos)
        if match is None:  # a quote where none may be, or an unterminated quoted string
            raise ForwardingHeaderError(
                f"hop {hop} from the right of the forwarded header has a malformed quoted "
                f"string: {_show(element)}"
            )
        name, value, separator = match.groups()
        if value is not None:
            if value.startswith('"'):
                value = _ESCAPED.sub(r"\1", value[1:-1])
            yield name.strip(), value.strip()
        elif name.strip():
            raise ForwardingHeaderError(
                f"hop {hop} from the right of the forwarded header has a bad parameter: "
                f"{_show(name.strip())}"
            )
        if not separator:
            return
        pos = match.end()


def _for_node(element: str, hop: int) -> str:
    """The ``for=`` value of one RFC 7239 element, unquoted."""
    node: str | None = None
    for name, value in _pairs(element, hop):
        if name.lower() != "for":
            continue
        if node is not None:
            raise ForwardingHeaderError(
                f"hop {hop} from the right of the forwarded header has more than one for="
            )
        node = value
    if node is None:
        raise ForwardingHeaderError(
            f"hop {hop} from the right of the forwarded header has no for=: {_show(element)}"
        )
    return node


def _strip_port(node: str) -> str:
    """The host of ``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; garbage stays garbage."""
    if node.startswith("["):
        end = node.find("]")
        rest = node[end + 1 :]
        if end < 0 or (rest and not (rest[0] == ":" and _is_port(rest[1:]))):
            return node
        return node[1:end]
    # A bare IPv6 address has at least two colons; exactly one means IPv4:port.
    if node.count(":") == 1:
        host, _, port = node.partition(":")
        return host if _is_port(port) else node
    return node


def _is_port(text: str) -> bool:
    # RFC 7239 also allows an obfuscated port ("_abc"); it is discarded either way.
    return (text.isascii() and text.isdigit() and len(text) <= 5) or (
        len(text) > 1 and text[0] == "_"
    )


def _show(text: str) -> str:
    return repr(text if len(text) <= _SHOW_CHARS else text[:_SHOW_CHARS] + "...")
