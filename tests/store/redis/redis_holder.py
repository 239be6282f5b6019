"""A process holding one Redis claim: ``redis_holder.py URL PREFIX LEASE KEY``.

Prints its claim token as one line, then waits for ``save`` on stdin and
prints the Save's outcome and whether it still counted the claim as held.
"""

from __future__ import annotations

import asyncio
import sys

from porch.store.base import Claim, Save, StoredResponse
from porch.store.redis import RedisStore


async def main(url: str, prefix: str, lease: float, key: str) -> None:
    store = RedisStore(url, prefix=prefix, lease=lease)
    await store.open()
    try:
        claim = Claim(key)
        await store.apply([claim])
        print(claim.token, flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        save = Save(
            key, StoredResponse(b"holder", 201, (), b"from the holder"), 60, token=claim.token
        )
        await store.apply([save])
        print(save.outcome, flush=True)
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))
