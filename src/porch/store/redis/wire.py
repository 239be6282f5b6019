"""A store pipeline on the wire: its commands packed into one buffer of the Redis
protocol (RESP), sent on one pooled connection, each reply read in order.

redis-py's ``Pipeline`` runs each argument through its encoder into a buffer joined
again per argument, and each command through the client's stack (response callbacks,
retries, observability hooks). A store's commands need none of it: each is ``EVALSHA``
of a loaded script (or an ``HMGET``) with bytes, str, int and float arguments, and
every reply is taken raw. Packed here, each command costs the event loop less
(docs/benchmarks.md, "A Redis command's own CPU"); connecting, timeouts and reading
replies stay redis-py's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.asyncio import ConnectionPool

    from .commands import Command

__all__ = ["heads", "pack", "run"]


def heads(shas: Mapping[str, str]) -> dict[str | None, bytes]:
    """Each script's command head (``EVALSHA`` and its SHA) by name, and None's (``HMGET``),
    packed once: a command's first two arguments."""
    found: dict[str | None, bytes] = {None: b"$5\r\nHMGET\r\n"}
    for name, sha in shas.items():
        found[name] = b"$7\r\nEVALSHA\r\n$%d\r\n%s\r\n" % (len(sha), sha.encode("ascii"))
    return found


# An argument longer than this (a stored response's body) is sent as its own chunk, not
# copied into the pipeline's buffer: a copy costs more than a write of its own there.
_SEPARATE = 16 * 1024


def pack(commands: Sequence[Command], heads: Mapping[str | None, bytes]) -> list[bytes]:
    """``commands`` as the chunks of one pipeline (one, unless an argument is long).
    Arguments are encoded as redis-py encodes them (floats as ``repr``, which Lua's
    ``tonumber`` reads back exactly); any other type is a TypeError, before anything is
    sent."""
    chunks: list[bytes] = []
    out: list[bytes] = []
    append = out.append
    for script, keys, args in commands:
        if script is None:  # HMGET record field...
            append(b"*%d\r\n" % (1 + len(keys) + len(args)))
        else:  # EVALSHA sha numkeys key... arg...
            append(b"*%d\r\n" % (3 + len(keys) + len(args)))
        append(heads[script])
        if script is not None:
            count = b"%d" % len(keys)
            append(b"$%d\r\n%s\r\n" % (len(count), count))
        for key in keys:
            append(b"$%d\r\n%s\r\n" % (len(key), key))
        for arg in args:
            kind = type(arg)
            if kind is bytes:
                value: bytes = arg  # type: ignore[assignment]
            elif kind is str:
                value = arg.encode()  # type: ignore[union-attr]
            elif kind is int or kind is float:
                value = repr(arg).encode()
            else:
                raise TypeError(f"a Redis command argument cannot be {kind.__name__}")
            if len(value) > _SEPARATE:
                append(b"$%d\r\n" % len(value))
                chunks += [b"".join(out), value]
                out.clear()
                append(b"\r\n")
            else:
                append(b"$%d\r\n%s\r\n" % (len(value), value))
    chunks.append(b"".join(out))
    return chunks


async def run(pool: ConnectionPool, packed: list[bytes], count: int) -> list[Any]:
    """Send one packed pipeline of ``count`` commands and read its replies: a command's
    error reply in its place (as redis-py's ``execute(raise_on_error=False)``).

    redis-py's connection bounds each write and read by the pool's socket timeout and
    closes itself when either fails or is cancelled: a connection given back is never
    left halfway through a pipeline's replies."""
    from redis.exceptions import ResponseError

    connection = await pool.get_connection()  # type: ignore[no-untyped-call,unused-ignore]
    try:
        await connection.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    finally:
        await pool.release(connection)
