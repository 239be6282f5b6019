"""A sharded store with one server stopped: errors for the keys homed there, only."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from porch.errors import StoreError
from porch.pool import KeyPool
from porch.store import Hit, ShardedStore, open_store
from servers import running_postgres
from support import HitCall

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.sharded, pytest.mark.slow]

US = "\x1f"


async def test_a_stopped_server_fails_only_the_keys_homed_there(postgres_url: str) -> None:
    """40 clients over two servers, through one key pool (its batches mix both homes):
    with the second server stopped, every request homed on the first is answered and
    every one homed on the second fails (a StoreError: 503), within the store's deadline;
    once it is back, the same store serves them all again."""
    pytest.importorskip("asyncpg")
    schema = f"porch_f{uuid.uuid4().hex[:10]}"
    with running_postgres() as second:
        store = ShardedStore(
            [open_store(postgres_url, schema=schema), open_store(second.url, schema=schema)]
        )
        pool = KeyPool(store, size=2)
        await pool.start()
        try:
            keys = [f"rl{US}api{US}minute{US}client:{i}" for i in range(40)]
            homes = {key: store.home(key) for key in keys}
            assert set(homes.values()) == {0, 1}

            async def ask(key: str) -> Hit | StoreError:
                call = HitCall(Hit([key], [100], [3600.0]))
                pool.submit(key, call)
                try:
                    hit: Hit = await asyncio.wait_for(call.future, 30)
                except StoreError as exc:
                    return exc
                return hit

            answers = await asyncio.gather(*(ask(key) for key in keys))
            assert all(isinstance(a, Hit) and a.allowed for a in answers)
            second.stop()
            answers = await asyncio.gather(*(ask(key) for key in keys))
            for key, answer in zip(keys, answers, strict=True):
                if homes[key] == 0:
                    assert isinstance(answer, Hit), key
                    assert answer.allowed, key
                else:
                    assert isinstance(answer, StoreError), key
            second.start()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                answers = await asyncio.gather(*(ask(key) for key in keys))
                if all(isinstance(a, Hit) for a in answers):
                    break
                assert loop.time() < deadline, "the second server's keys are not served again"
                await asyncio.sleep(0.2)
        finally:
            await pool.close()
            import asyncpg

            conn = await asyncpg.connect(postgres_url, timeout=10)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()
