"""How the network stores keep a body's parts in a stored head (see ``PartStore``).

PostgreSQL and Redis keep a stored response's head as one text field; the
reference of a body streamed in parts travels in it as the pseudo-header
``porch-parts: <id> <count> <length>``, which no handler's response can carry into
the store (only a replay's allow-listed headers are stored) and the stores take
out again when they read the head back.
"""

from __future__ import annotations

from .base import Parts

__all__ = ["PARTS_HEADER", "join_parts", "split_parts"]

PARTS_HEADER = b"porch-parts"

Head = tuple[tuple[bytes, bytes], ...]


def join_parts(headers: Head, parts: Parts | None) -> Head:
    """The head to store: ``headers``, and the parts' reference if the body is in parts."""
    if parts is None:
        return headers
    return (*headers, (PARTS_HEADER, b"%d %d %d" % (parts.id, parts.count, parts.length)))


def split_parts(headers: Head) -> tuple[Head, Parts | None]:
    """A stored head as read: the response's headers, and its body's parts (None: the body
    is whole). A malformed reference reads as none."""
    if not any(name == PARTS_HEADER for name, _ in headers):
        return headers, None
    found: Parts | None = None
    kept = []
    for name, value in headers:
        if name != PARTS_HEADER:
            kept.append((name, value))
            continue
        try:
            body, count, length = (int(field) for field in value.split(b" "))
        except ValueError:
            continue
        found = Parts(body, count, length)
    return tuple(kept), found
