"""A process holding one PostgreSQL claim: ``holder.py URL SCHEMA LEASE KEY``.

Opens a :class:`~porch.store.postgres.PostgresStore`, claims KEY and prints
the claim as one JSON line; then answers ``save BODY`` (a 201 fenced by the
claim's token) or ``exit`` from stdin, one JSON line each. The tests SIGSTOP
or kill -9 it in between: its heartbeat is all that keeps the claim alive.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from porch.store.base import Claim, Save, StoredResponse
from porch.store.postgres import PostgresStore


def say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def main(url: str, schema: str, lease: float, key: str) -> None:
    store = PostgresStore(url, schema=schema, lease=lease)
    await store.open()
    try:
        claim = Claim(key)
        await store.apply([claim])
        say(pid=os.getpid(), token=claim.token, held=claim.held)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            command, _, rest = line.strip().partition(" ")
            if command != "save":
                break
            save = Save(
                key, StoredResponse(b"holder", 201, (), rest.encode()), 60.0, token=claim.token
            )
            await store.apply([save])
            say(outcome=save.outcome)
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))
