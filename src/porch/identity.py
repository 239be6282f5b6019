"""Which client a request comes from: the key the rate limiter counts under.

By default the key is the connection's peer host and forwarding headers are
ignored, because anyone can send them. Behind proxies, name them, either by
count (``trust_hops``) or by network (``trusted_proxies``), and the key is the
address the nearest untrusted hop was seen from.

Only the entries the walk has to read are validated: those are written by a
trusted proxy. Entries further left are client-supplied; rejecting the request
over them would let any client push itself onto the proxy's shared key.
Anything wrong with an entry that is read falls back to the peer host with
one warning; identifying a client never fails a request.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Sequence
from typing import Literal

from ._types import Scope
from .errors import ConfigurationError

__all__ = ["ClientIdentity", "KeyFunc"]

KeyFunc = Callable[[Scope], str]

_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_log = logging.getLogger("porch.identity")

_HEADERS = ("x-forwarded-for", "forwarded")
_UNKNOWN = "unknown"
# Enough of a bad entry to recognise it; the rest could be kilobytes of client text.
_SHOW_CHARS = 64


class _Untrusted(Exception):
    """A forwarding header that cannot be read; the message says why."""


class ClientIdentity:
    """Finds the client key of an ASGI request: the peer host, or the client named by trusted
    proxies.

    ``trust_hops``: how many proxies in front of the app append to the header (the
    peer is the nearest). ``trusted_proxies``: the networks proxies connect from.
    ``max_hops`` bounds the header's entries, not counting the peer. Without either
    setting the peer host is used as the server reports it; with one, it is
    normalized like every forwarded address.
    """

    __slots__ = (
        "_group_ipv6",
        "_header",
        "_header_name",
        "_max_header_bytes",
        "_max_hops",
        "_trust_hops",
        "_trusted",
        "_walks",
    )

    _group_ipv6: bool
    _header: str
    _header_name: bytes
    _max_header_bytes: int
    _max_hops: int
    _trust_hops: int
    _trusted: tuple[_IPNetwork, ...]
    _walks: bool

    def __init__(
        self,
        *,
        trust_hops: int = 0,
        trusted_proxies: Sequence[str] = (),
        header: Literal["x-forwarded-for", "forwarded"] = "x-forwarded-for",
        group_ipv6: bool = False,
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
        if max_header_bytes < 1:
            raise ConfigurationError(f"max_header_bytes must be >= 1, got {max_header_bytes}")
        if max_hops < 1:
            raise ConfigurationError(f"max_hops must be >= 1, got {max_hops}")
        trusted: list[_IPNetwork] = []
        for entry in trusted_proxies:
            try:
                trusted.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                raise ConfigurationError(
                    f"trusted_proxies entry {entry!r} is not an IP address or network"
                ) from None
        init = object.__setattr__
        init(self, "_trust_hops", trust_hops)
        init(self, "_trusted", tuple(trusted))
        init(self, "_walks", trust_hops > 0 or bool(trusted))
        init(self, "_header", header)
        init(self, "_header_name", header.encode("ascii"))
        init(self, "_group_ipv6", group_ipv6)
        init(self, "_max_header_bytes", max_header_bytes)
        init(self, "_max_hops", max_hops)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __call__(self, scope: Scope) -> str:
        if self._walks:
            return self._forwarded_key(scope)
        # The hot path: no header scan and no parsing unless IPv6 grouping needs it.
        client = scope.get("client")
        if client is None:
            return _UNKNOWN
        host: str = client[0]
        if self._group_ipv6 and ":" in host:
            return self._peer_key(host)
        return host

    def _forwarded_key(self, scope: Scope) -> str:
        client = scope.get("client")
        peer: str | None = None if client is None else client[0]
        try:
            if self._trusted:
                return self._walk_trusted(scope, peer)
            return self._walk_hops(scope, peer)
        except _Untrusted as exc:
            key = self._peer_key(peer)
            _log.warning("ignoring the %s header: %s; using the peer %r", self._header, exc, key)
            return key

    def _walk_hops(self, scope: Scope, peer: str | None) -> str:
        entries = self._entries(scope)
        # chain = entries + [peer]; the client is chain[-(hops + 1)], or chain[0] if short.
        if not entries:
            return self._peer_key(peer)
        index = max(len(entries) - self._trust_hops, 0)
        return self._key(self._parse(entries[index], len(entries) - index))

    def _walk_trusted(self, scope: Scope, peer: str | None) -> str:
        peer_ip = None if peer is None else _parse_ip(peer)
        # An untrusted peer wrote the headers itself: they mean nothing.
        if peer_ip is None or not self._is_trusted(peer_ip):
            return self._peer_key(peer)
        ip = peer_ip
        entries = self._entries(scope)
        for hop, entry in enumerate(reversed(entries), start=1):
            ip = self._parse(entry, hop)
            if not self._is_trusted(ip):
                return self._key(ip)
        return self._key(ip)

    def _is_trusted(self, ip: _IPAddress) -> bool:
        # Cross-version membership is simply False, so one list serves both families.
        return any(ip in network for network in self._trusted)

    def _entries(self, scope: Scope) -> list[str]:
        """The header's hops, left to right, unparsed."""
        values: list[bytes] = []
        size = -1
        for name, value in scope.get("headers", ()):
            if name == self._header_name:
                values.append(value)
                size += len(value) + 1
                # Checked while collecting, so a flood of header lines costs no join.
                if size > self._max_header_bytes:
                    raise _Untrusted(f"it is over max_header_bytes={self._max_header_bytes}")
        if not values:
            return []
        # Splitting on every comma, quoted or not, keeps the proxy-appended right end
        # readable whatever a client put on the left (no for= value contains a comma).
        entries = b",".join(values).decode("latin-1").split(",")
        if len(entries) > self._max_hops:
            raise _Untrusted(f"it has {len(entries)} hops, over max_hops={self._max_hops}")
        return entries

    def _parse(self, entry: str, hop: int) -> _IPAddress:
        """The address in one entry; ``hop`` counts from the right, for the warning."""
        node = _for_node(entry, hop) if self._header == "forwarded" else entry.strip()
        ip = _parse_ip(_strip_port(node))
        if ip is None:
            raise _Untrusted(f"hop {hop} from the right is not an IP address: {_show(node)}")
        return ip

    def _peer_key(self, peer: str | None) -> str:
        if peer is None:
            return _UNKNOWN
        ip = _parse_ip(peer)
        # Not every peer is an address (a unix socket path, a test client's name).
        return peer if ip is None else self._key(ip)

    def _key(self, ip: _IPAddress) -> str:
        if self._group_ipv6 and ip.version == 6:
            # One host commonly holds a whole /64; counting each address would not limit it.
            return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
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


def _for_node(element: str, hop: int) -> str:
    """The ``for=`` value of one RFC 7239 element, unquoted."""
    node: str | None = None
    for pair in element.split(";"):
        name, eq, value = pair.partition("=")
        if not eq:
            raise _Untrusted(f"hop {hop} from the right has a bad parameter: {_show(pair)}")
        if name.strip().lower() != "for":
            continue
        if node is not None:
            raise _Untrusted(f"hop {hop} from the right has more than one for=")
        node = value.strip()
    if node is None:
        raise _Untrusted(f"hop {hop} from the right has no for=: {_show(element)}")
    if len(node) >= 2 and node[0] == node[-1] == '"':
        node = node[1:-1]
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
