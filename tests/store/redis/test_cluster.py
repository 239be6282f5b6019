"""The Redis Cluster store's own parts: its URL, and a slot moved under load (MOVED/ASK).

What every store must do is proven by the conformance suite (backend
``redis-cluster``); the failover gate is tests/e2e/test_gate_cluster.py.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import threading
from collections import Counter

import pytest

from porch.errors import ConfigurationError
from porch.store import open_store
from porch.store.base import Claim, Hit, Save, StoredResponse
from porch.store.redis.cluster import RedisClusterStore, cluster_client, parse_cluster_url
from servers import running_redis_cluster

pytest.importorskip("redis")


def test_the_url_names_seeds_and_porchs_options() -> None:
    parsed = parse_cluster_url(
        "redis+cluster://:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002/0?wait_replicas=1&wait_timeout=2"
    )
    assert parsed.seeds == [("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002)]
    assert (parsed.wait_replicas, parsed.wait_timeout, parsed.tls) == (1, 2.0, False)
    assert parsed.options["password"] == "pw"
    assert parse_cluster_url("rediss+cluster://h:1").tls
    assert isinstance(open_store("redis+cluster://127.0.0.1:7000"), RedisClusterStore)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://h:1/3", "database 0 only"),
        ("redis+cluster://h:x", "host:port"),
        ("redis+cluster://:1", "host:port"),
        ("redis+cluster://h:1?wait_replicas=many", "wait_replicas is a whole number"),
        ("redis+cluster://h:1?wait_replicas=17", "0-16"),
        ("redis+cluster://h:1?wait_timeout=0", "wait_timeout must be"),
        ("redis://h:1", "starts with redis\\+cluster://"),
    ],
)
def test_a_bad_url_is_a_configuration_error(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        RedisClusterStore(url)


def test_a_password_never_shows(caplog: pytest.LogCaptureFixture) -> None:
    store = RedisClusterStore("redis+cluster://:hunter2@10.0.0.1:7000")
    assert "hunter2" not in repr(store)
    with pytest.raises(ConfigurationError) as refused:
        RedisClusterStore("redis+cluster://:hunter2@10.0.0.1:7000/5")
    assert "hunter2" not in str(refused.value)


def test_a_redis_py_without_sharded_pub_sub_is_refused_when_the_store_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # redis-py 7 has no SSUBSCRIBE in redis.asyncio: the wake-ups would never subscribe
    # (an open that failed after its timeout). Said at construction, naming the extra.
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "7.4.1")
    with pytest.raises(ConfigurationError, match=r"redis-py 8.0 or newer .* found 7.4.1"):
        RedisClusterStore("redis+cluster://10.0.0.1:7000")


RULE = "rl\x1fmove\x1f{}\x1fclient-7"  # one rule and level: one tag, one slot
LIMITS = 240  # keys in the moved slot: MIGRATE moves them 100 at a time
HITS = 3000


@pytest.mark.slow
@pytest.mark.redis
def test_a_slot_moved_under_load_loses_no_count_and_no_claim() -> None:
    """Hits and claims on one slot while ``redis-cli``'s way of resharding moves it to
    another primary (IMPORTING/MIGRATING, MIGRATE 100 keys at a time): the clients meet
    ASK, TRYAGAIN and then MOVED; every hit allowed is counted once, every key claimed is
    claimed once."""
    with running_redis_cluster() as cluster:

        async def run() -> tuple[Counter[str], dict[str, int], list[int]]:
            store = RedisClusterStore(cluster.url, prefix="mv")
            await store.open()
            names = store.names
            keys = [RULE.format(f"l{i}") for i in range(LIMITS)]
            slot = cluster.slot(names.counter(keys[0]))
            assert {cluster.slot(names.counter(key)) for key in keys} == {slot}
            # The records of scope "s" are in one slot too, moved after the counters'.
            records = cluster.slot(names.record("s\x1fany"))
            allowed: Counter[str] = Counter()
            tokens: list[int] = []
            for key in keys:  # the slot holds every key before the move begins
                hit = Hit([key], [10**9], [600.0])
                await store.apply([hit])
                allowed[key] += 1
            moved = threading.Event()

            def move() -> None:
                try:
                    for which in (slot, records):
                        home = cluster.primary_of(which)
                        target = next(p for p in cluster.primaries() if p is not home)
                        cluster.move_slot(which, target)
                finally:
                    moved.set()

            mover = threading.Thread(target=move)
            mover.start()
            try:
                sent = 0
                while sent < HITS and not (moved.is_set() and sent > LIMITS):
                    batch = [Hit([keys[(sent + i) % LIMITS]], [10**9], [600.0]) for i in range(8)]
                    claims = [Claim(f"s\x1fmove-{sent}-{i}", scope="s") for i in range(2)]
                    await asyncio.wait_for(store.apply([*batch, *claims]), 30)
                    sent += len(batch)
                    for hit in batch:
                        assert hit.allowed
                        allowed[hit.keys[0]] += 1
                    for claim in claims:
                        assert claim.token
                        tokens.append(claim.token)
                        save = Save(
                            claim.key,
                            StoredResponse(b"d", 200, (), b"x"),
                            600.0,
                            token=claim.token,
                            scope="s",
                        )
                        await asyncio.wait_for(store.apply([save]), 30)
                        assert save.outcome == "saved"
                        again = Claim(claim.key, scope="s")
                        await asyncio.wait_for(store.apply([again]), 30)
                        assert again.stored is not None  # claimed once, stored, replayed
            finally:
                await asyncio.to_thread(mover.join, 60)
                await store.close()
            client = cluster_client(cluster.url)
            try:
                counted = {key: int(await client.hget(names.counter(key), "n")) for key in keys}
            finally:
                await client.aclose()
            return allowed, counted, tokens

        allowed, counted, tokens = asyncio.run(run())
        assert counted == dict(allowed)
        assert len(set(tokens)) == len(tokens)
