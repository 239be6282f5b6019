"""The store's pipelines on the wire: packed as redis-py packs them, replies in order,
an error reply in its place, and a connection never given back halfway through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio.connection import Connection
from redis.exceptions import NoScriptError, ResponseError

from porch.store.redis import wire
from porch.store.redis.commands import Command

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

DEADLINE = 10.0
# Each kind of argument the store's commands carry, the awkward values of each.
ARGS: list[bytes | str | int | float] = [
    b"",
    b"\x00\r\n$3\r\n",  # protocol bytes inside an argument are only its bytes
    "",
    "caf\u00e9 \u2603",
    0,
    -7,
    2**63 - 1,
    0.1,
    1 / 3,
    1e22,
    -0.0,
    1764777600.123456,
]
ECHO = "return ARGV"  # a script answering its arguments as it read them
SLOW = """
local function now() local t = redis.call('TIME'); return t[1] * 1e6 + t[2] end
local start = now()
repeat until now() - start >= 1e6
return 1
"""  # a script that takes a second


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    c = redis.asyncio.Redis.from_url(redis_url)
    yield c
    await c.aclose()
    await c.connection_pool.disconnect()


async def _heads(client: redis.asyncio.Redis, **sources: str) -> dict[str | None, bytes]:
    shas = {name: await client.script_load(source) for name, source in sources.items()}
    return wire.heads(
        {name: sha if isinstance(sha, str) else sha.decode() for name, sha in shas.items()}
    )


def test_commands_are_packed_byte_for_byte_as_redis_py_packs_them() -> None:
    sha = "0123456789abcdef0123456789abcdef01234567"
    commands: list[Command] = [
        ("echo", [b"porch:k1", b"porch:k2"], ARGS),
        (None, [b"porch:record"], [b"d", b"s"]),
        ("echo", [], []),
    ]
    packer = Connection()
    expected = b"".join(
        packer.pack_commands(
            [
                ("EVALSHA", sha, 2, b"porch:k1", b"porch:k2", *ARGS),
                ("HMGET", b"porch:record", b"d", b"s"),
                ("EVALSHA", sha, 0),
            ]
        )
    )
    assert b"".join(wire.pack(commands, wire.heads({"echo": sha}))) == expected


def test_a_long_argument_is_sent_as_it_is_not_copied() -> None:
    body = bytes(range(256)) * 400  # a stored response's body, 100 KiB
    sha = "0" * 40
    heads = wire.heads({"save": sha})
    chunks = wire.pack([("save", [b"k"], [1, body, 2]), ("save", [], [])], heads)
    assert any(chunk is body for chunk in chunks)
    expected = Connection().pack_commands(
        [("EVALSHA", sha, 1, b"k", 1, body, 2), ("EVALSHA", sha, 0)]
    )
    assert b"".join(chunks) == b"".join(expected)


@pytest.mark.parametrize("bad", [True, None, 1.5j, bytearray(b"x")])
def test_an_argument_of_another_type_fails_before_anything_is_sent(bad: Any) -> None:
    heads = wire.heads({"echo": "0" * 40})
    with pytest.raises(TypeError, match="argument cannot be"):
        wire.pack([("echo", [b"k"], [1, bad])], heads)


async def test_replies_come_in_order_and_an_error_reply_in_its_place(
    client: redis.asyncio.Redis,
) -> None:
    heads = await _heads(client, echo=ECHO)
    heads["gone"] = wire.heads({"gone": "f" * 40})["gone"]  # never loaded: NOSCRIPT
    await client.hset("porch-wire:record", mapping={"d": b"digest", "s": b"201"})
    commands: list[Command] = [
        ("echo", [b"porch-wire:a"], ARGS),
        ("gone", [b"porch-wire:a"], [1]),
        (None, [b"porch-wire:record"], [b"d", b"s", b"absent"]),
    ]
    replies = await asyncio.wait_for(
        wire.run(client.connection_pool, wire.pack(commands, heads), len(commands)), DEADLINE
    )
    # What Lua's ARGV read: every argument's bytes as redis-py would have sent them.
    encoder = Connection().encoder
    assert replies[0] == [encoder.encode(arg) for arg in ARGS]  # type: ignore[no-untyped-call]
    assert isinstance(replies[1], NoScriptError)
    assert replies[2] == [b"digest", b"201", None]
    await client.delete("porch-wire:record")


class _Sending(Connection):
    """A connection that says when a script call is on the wire (not its handshake's
    commands as it connects)."""

    sent: asyncio.Event

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        await super().send_packed_command(command, check_health)
        if isinstance(command, list) and b"EVALSHA" in command[0]:
            type(self).sent.set()


async def test_a_run_cancelled_before_its_replies_leaves_no_reply_for_the_next(
    client: redis.asyncio.Redis, redis_url: str
) -> None:
    # One connection: the next run gets the one the cancelled run had, unless it closed.
    _Sending.sent = asyncio.Event()
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=1, connection_class=_Sending
    )
    try:
        heads = await _heads(client, echo=ECHO, slow=SLOW)
        slow = asyncio.ensure_future(wire.run(pool, wire.pack([("slow", [], [])], heads), 1))
        await asyncio.wait_for(_Sending.sent.wait(), DEADLINE)  # its reply is a second away
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        replies = await asyncio.wait_for(
            wire.run(pool, wire.pack([("echo", [], ["mine"])], heads), 1), DEADLINE
        )
        assert replies == [[b"mine"]]  # not the slow script's 1
    finally:
        await pool.disconnect()


async def test_a_reply_error_of_the_script_itself_is_in_its_place(
    client: redis.asyncio.Redis,
) -> None:
    heads = await _heads(client, fails="return redis.error_reply('porch says no')", echo=ECHO)
    commands: list[Command] = [("fails", [], []), ("echo", [], [7])]
    replies = await asyncio.wait_for(
        wire.run(client.connection_pool, wire.pack(commands, heads), 2), DEADLINE
    )
    assert isinstance(replies[0], ResponseError)
    assert "porch says no" in str(replies[0])
    assert replies[1] == [b"7"]
