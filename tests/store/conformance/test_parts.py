"""Bodies streamed in parts (the store's PartStore), on every backend: written part by part,
named by a Save only once whole, replayed part by part from any store, counted whole
against quotas; a body no record names is never replayed and goes."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from porch.errors import StoreError
from porch.store.base import Claim, Lookup, Parts, PartStore, Quota, Save, Store, StoredResponse

from .conftest import Backend

pytestmark = pytest.mark.anyio

DIGEST = bytes(range(32))
HEAD = ((b"content-type", b"application/octet-stream"), (b"location", b"/exports/7"))


def parts_of(store: Store) -> PartStore:
    found = store.capabilities.parts
    assert found is not None, "every backend keeps bodies in parts"
    return found


def grace(backend: Backend, seconds: float) -> dict[str, Any]:
    """Options for a store whose unnamed bodies go ``seconds`` after their last part (and,
    on SQLite, whose side file sweeps often)."""
    options: dict[str, Any] = {"part_grace": seconds}
    if backend.name == "sqlite":
        options["upkeep_after"] = 0.05
    return options


async def stream(store: Store, key: str, body: int, data: bytes, size: int) -> Parts:
    """Write ``data`` as parts of ``size`` bytes and keep it; its reference."""
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    for index, piece in enumerate(pieces):
        await parts_of(store).write(key, body, index, piece)
    parts = Parts(body, len(pieces), len(data))
    await parts_of(store).keep(key, parts, 60.0)
    return parts


async def read_all(store: Store, key: str, parts: Parts) -> bytes:
    found = [await parts_of(store).read(key, parts, i) for i in range(parts.count)]
    assert all(piece is not None for piece in found)
    return b"".join(piece for piece in found if piece is not None)


async def eventually_gone(store: Store, key: str, parts: Parts, within: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while await parts_of(store).read(key, parts, 0) is not None:
        assert loop.time() < deadline, f"body {parts.id} of {key!r} is still there"
        await asyncio.sleep(0.05)


async def test_a_body_in_parts_comes_back_part_by_part_to_any_store(backend: Backend) -> None:
    one, other = await backend.store(), await backend.store()
    data = os.urandom(250_000)
    claim = Claim("p:k")
    await one.apply([claim])
    parts = await stream(one, "p:k", 1234567, data, 100_000)
    assert parts == Parts(1234567, 3, 250_000)
    response = StoredResponse(DIGEST, 201, HEAD, b"", parts)
    save = Save("p:k", response, 60.0, token=claim.token)
    await one.apply([save])
    assert save.outcome == "saved"
    for store in (one, other):
        lookup = Lookup("p:k")
        await store.apply([lookup])
        assert lookup.result == response  # the head as it was, the reference to the parts
        assert await read_all(store, "p:k", parts) == data
        assert await parts_of(store).read("p:k", parts, 3) is None
        # Another key cannot read it, whatever reference it holds.
        assert await parts_of(store).read("p:other", parts, 0) is None
    again = Claim("p:k")
    await other.apply([again])
    assert (again.token, again.stored) == (0, response)


async def test_quotas_count_a_body_in_parts_whole(backend: Backend) -> None:
    backend.quotas_across_keys()
    store = await backend.store()
    quota = Quota(scope_bytes=5_000, total_bytes=100_000, client_bytes=5_000)
    claim = Claim("pq:a", scope="s", client="c", quota=quota, reserve=5_000)
    await store.apply([claim])
    assert claim.token > 0
    parts = await stream(store, "pq:a", 42, b"q" * 4_000, 3_000)
    save = Save(
        "pq:a",
        StoredResponse(DIGEST, 200, (), b"", parts),
        60.0,
        token=claim.token,
        scope="s",
        client="c",
        quota=quota,
    )
    assert save.size == len("pq:a") + len(DIGEST) + 4_000
    await store.apply([save])
    assert save.outcome == "saved"
    # Its 4,000 bytes count: another 2,000 do not fit the scope's or client's 5,000.
    refused = Claim("pq:b", scope="s", client="c", quota=quota, reserve=2_000)
    await store.apply([refused])
    assert (refused.token, refused.over) == (0, "scope")


async def test_only_a_whole_body_can_be_kept(backend: Backend) -> None:
    store = await backend.store()
    parts = parts_of(store)
    await parts.write("pw:k", 7, 0, b"a" * 10)
    await parts.write("pw:k", 7, 2, b"c" * 10)
    with pytest.raises(StoreError):  # part 1 is missing
        await parts.keep("pw:k", Parts(7, 3, 30), 60.0)
    await parts.write("pw:k", 7, 1, b"b" * 10)
    with pytest.raises(StoreError):  # not the length its reference says
        await parts.keep("pw:k", Parts(7, 3, 31), 60.0)
    with pytest.raises(StoreError):  # another key's
        await parts.keep("pw:other", Parts(7, 3, 30), 60.0)
    await parts.keep("pw:k", Parts(7, 3, 30), 60.0)
    assert await read_all(store, "pw:k", Parts(7, 3, 30)) == b"a" * 10 + b"b" * 10 + b"c" * 10


async def test_a_body_its_owner_left_mid_stream_is_never_replayed_and_goes(
    backend: Backend,
) -> None:
    store = await backend.store(**grace(backend, 1.0))
    # One home for both bodies (a new body's writer sweeps its own store's expired ones).
    key, fresh = backend.together(store, "pc:k", "pc:new", counter=False)
    holder = await backend.holder(key, **grace(backend, 1.0), **backend.lease(1.0))
    assert holder.token > 0
    assert await holder.send("part 77 0 1000") == {"written": True}
    assert await holder.send("part 77 1 1000") == {"written": True}
    await holder.kill()  # mid-stream: its body is in the store, no record names it
    kept_data = os.urandom(3_000)
    kept = await stream(store, "pc:kept", 88, kept_data, 1_000)
    named = StoredResponse(DIGEST, 201, HEAD, b"", kept)
    save = Save("pc:kept", named, 3600.0)
    await store.apply([save])
    assert save.outcome == "saved"
    await backend.elapse(1.5)  # past the holder's lease and both bodies' grace
    if backend.clock is not None:
        # The holder wrote its parts at its system clock's time, which ran on (its
        # start-up) while the test's manual clock stood still: past that too.
        backend.clock.advance(60.0)
    claim = Claim(key)
    await store.apply([claim])
    assert (claim.token > 0, claim.stored) == (True, None)
    # A new body (PostgreSQL's processes sweep expired bodies as they start one).
    await parts_of(store).write(fresh, 99, 0, b"n")
    await eventually_gone(store, key, Parts(77, 2, 2_000))
    # The named body stays as long as its record, whatever the grace.
    lookup = Lookup("pc:kept")
    await store.apply([lookup])
    assert lookup.result == named
    assert await read_all(store, "pc:kept", kept) == kept_data


async def test_a_dropped_body_goes(backend: Backend) -> None:
    store = await backend.store()
    parts = parts_of(store)
    await parts.write("pd:k", 5, 0, b"x" * 100)
    await parts.write("pd:k", 5, 1, b"y" * 50)
    parts.drop("pd:k", 5)
    await eventually_gone(store, "pd:k", Parts(5, 2, 150))
