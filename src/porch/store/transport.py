"""Whether a network store is reached over a path others can read, said once per store.

Counters, stored responses (bodies, ``Location``) and the store's password cross
the wire to a PostgreSQL or Redis server. On loopback or a unix socket that wire
is this host's; anywhere else, without TLS, anyone on the path reads and can
change them, and TLS without a certificate check stops only a passive listener.
Each network store calls :func:`check_transport` once, after its first open
(docs/deployment.md, "TLS to the store", shows the settings).
"""

from __future__ import annotations

import ipaddress
import logging

from .urls import redact

__all__ = ["check_transport", "is_local"]

logger = logging.getLogger("porch.store")


def is_local(host: str | None) -> bool:
    """Whether ``host`` (an address or name as the URL gives it; None or a path: a unix
    socket) is this host: loopback, ``localhost`` or a socket path. A name is not
    resolved: it is taken to be another host."""
    if not host or host.startswith("/"):
        return True
    text = host.strip("[]").lower()
    if text == "localhost" or text.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def check_transport(
    backend: str, url: str, peer: str | None, *, tls: bool, verified: bool, setting: str
) -> str | None:
    """Warn (and return the message) when ``peer`` is not this host and the connection is
    not TLS with a certificate check; None when it is fine. ``setting`` names what fixes it."""
    if is_local(peer):
        return None
    if not tls:
        how = "without TLS: anyone on the path can read and change what porch stores"
    elif not verified:
        how = "over TLS without a certificate check: anyone on the path can pose as the server"
    else:
        return None
    message = (
        f"porch: the {backend} store {redact(url)} is reached at {peer} {how}; use {setting}"
        " (docs/deployment.md, 'TLS to the store')"
    )
    logger.warning(message)
    return message
