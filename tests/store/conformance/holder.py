"""A claim holder in a process of its own: ``holder.py URL OPTIONS_JSON KEY``.

Opens the store with ``porch.open_store(URL, **OPTIONS)`` (URL may be a JSON list: a
sharded store's servers), claims KEY and
prints the claim as one JSON line (KEY ``-``: claims nothing). Then, one command
per stdin line, answering each with one JSON line: ``save TTL BODY`` (store a
201 with BODY, fenced by the claim's token), ``release``, ``hit KEY AMOUNT
WINDOW [ALGORITHM [BURST]]`` (one Hit: its verdict, remaining, next and wall
time), ``slot KEY CAP`` (one Hit taking a concurrency slot of KEY, held until the
process ends or ``vacate``: its verdict and in-flight count), ``vacate`` (frees
every slot taken), ``part BODY INDEX SIZE`` (writes part INDEX of body BODY of KEY,
SIZE bytes of ``p``, to the store's PartStore), ``probe-clock`` (this process's own
wall clock), ``block SECONDS`` (answers ``blocking``, then blocks its event loop
with synchronous work, as a handler doing sync I/O in an ``async def`` does, then
answers ``blocked``), ``exit``. The tests kill it (-9)
or freeze it (SIGSTOP) in between; while it waits for a command it costs no CPU.

``claim KEY`` claims KEY (its token and whether it is held elsewhere).
``PORCH_HOLDER_LATE_REPLY`` (seconds): the first claim's reply is read that late, its
event loop blocked as it reads the reply (after answering ``late``), as a loop busy with
a handler's synchronous work reads it.

``PORCH_HOLDER_CLAIM`` (JSON: ``scope``, ``client``, ``reserve`` and ``quota`` as
``[scope_bytes, total_bytes, client_bytes]``) makes the claim reserve quota bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import sys
import time
from typing import Any, cast

import porch
from porch.store.base import Algorithm, Claim, Hit, Quota, Release, Save, StoredResponse, Vacate


def say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def read_late(seconds: float) -> None:
    """The first claim's reply is read ``seconds`` late (see the module docstring):
    each lease store's reply reader is wrapped where the store calls it."""
    state = {"late": True}

    def block(ops: list[object]) -> None:
        # Before the reply is read: what it grants is not held (renewed) until then.
        if state["late"] and any(type(op) is Claim for op in ops):
            state["late"] = False
            say(late=True)
            time.sleep(seconds)

    with contextlib.suppress(ImportError):
        postgres: Any = importlib.import_module("porch.store.postgres.store")
        rows = postgres.fill_from_rows

        def fill_from_rows(sent: list[object], *args: Any) -> None:
            block(sent)
            rows(sent, *args)

        postgres.fill_from_rows = fill_from_rows
    for name in ("porch.store.redis.store", "porch.store.redis.cluster"):
        with contextlib.suppress(ImportError):
            redis: Any = importlib.import_module(name)
            reply = redis.fill_from_reply

            def fill_from_reply(held: Any, op: object, *args: Any, reply: Any = reply) -> None:
                block([op])
                reply(held, op, *args)

            redis.fill_from_reply = fill_from_reply


async def main(url: str, options: dict[str, object], key: str) -> None:
    if "PORCH_HOLDER_LATE_REPLY" in os.environ:
        read_late(float(os.environ["PORCH_HOLDER_LATE_REPLY"]))
    # A JSON list: one URL per server of a sharded store.
    store = porch.open_store(json.loads(url) if url.startswith("[") else url, **options)
    await store.open()
    try:
        reserving = json.loads(os.environ.get("PORCH_HOLDER_CLAIM", "{}"))
        if "quota" in reserving:
            reserving["quota"] = Quota(*reserving["quota"])
        claim = Claim(key, **reserving)
        if key != "-":
            await store.apply([claim])
        say(pid=os.getpid(), token=claim.token, held=claim.held, stored=claim.stored is not None)
        slots: list[Hit] = []
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            command, _, rest = line.strip().partition(" ")
            if command == "save":
                ttl, _, body = rest.partition(" ")
                response = StoredResponse(b"holder-digest", 201, (), body.encode())
                save = Save(key, response, float(ttl), token=claim.token)
                await store.apply([save])
                say(outcome=save.outcome)
            elif command == "claim":
                other = Claim(rest)
                await store.apply([other])
                say(token=other.token, held=other.held)
            elif command == "release":
                release = Release(key, claim.token)
                await store.apply([release])
                say(released=release.released)
            elif command == "slot":
                slot, cap = rest.split(" ")
                hit = Hit([], [], [], slots=[slot], caps=[int(cap)])
                await store.apply([hit])
                if hit.allowed:
                    slots.append(hit)
                say(allowed=hit.allowed, in_flight=hit.in_flight)
            elif command == "vacate":
                await store.apply([Vacate.of(hit) for hit in slots])
                say(vacated=len(slots))
                slots = []
            elif command == "part":
                body, index, size = (int(field) for field in rest.split(" "))
                parts = store.capabilities.parts
                if parts is None:
                    raise SystemExit("this store keeps no bodies in parts")
                await parts.write(key, body, index, b"p" * size)
                say(written=True)
            elif command == "probe-clock":  # what this process's own clock says
                say(now=time.time())
            elif command == "block":
                say(blocking=True)
                time.sleep(float(rest))  # noqa: ASYNC251 - the loop runs nothing meanwhile
                say(blocked=True)
            elif command == "hit":
                counter, amount, window, *policy = rest.split(" ")
                algorithm = cast(Algorithm, policy[0] if policy else "fixed")
                burst = int(policy[1]) if len(policy) > 1 else int(amount)
                hit = Hit([counter], [int(amount)], [float(window)], [algorithm], [burst])
                await store.apply([hit])
                say(allowed=hit.allowed, remaining=hit.remaining, next=hit.next, wall=hit.wall)
            else:  # "exit", or stdin closed
                break
    finally:
        await store.close()
    say(closed=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]))
