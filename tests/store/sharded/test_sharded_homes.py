"""Where keys live among several stores: rendezvous hashing, and what adding a server moves.

No server needed: homes are a pure function of the key and the stores' secrets.
"""

from __future__ import annotations

import os

import pytest

from porch.errors import ConfigurationError
from porch.store import ShardedStore, SQLiteStore, open_store
from porch.store.sharded import rendezvous
from porch.store.sharded.homes import counter_home_key, response_home_key

KEYS = [f"rl\x1fapi\x1fminute\x1fclient:{i}" for i in range(100_000)]


def homes(nodes: list[bytes]) -> list[int]:
    return [rendezvous(counter_home_key(key), nodes) for key in KEYS]


@pytest.mark.parametrize("servers", [2, 4, 9])
def test_adding_a_server_moves_about_one_in_n_keys_all_to_it(servers: int) -> None:
    """100,000 client keys over N servers, then N + 1: about 1/(N + 1) of them move
    (measured: printed), every one of them to the new server, and none between the old."""
    nodes = [os.urandom(32) for _ in range(servers)]
    before = homes(nodes)
    after = homes([*nodes, os.urandom(32)])
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    share = len(moved) / len(KEYS)
    print(
        f"{servers} -> {servers + 1} servers: {share:.4f} of keys moved",
        f"(1/N {1 / (servers + 1):.4f})",
    )
    assert abs(share - 1 / (servers + 1)) < 0.01
    assert all(after[i] == servers for i in moved)
    # Each server holds about its share (no server twice another's).
    counts = [after.count(n) for n in range(servers + 1)]
    assert max(counts) < 1.1 * len(KEYS) / (servers + 1) < 1.2 * min(counts)


def test_removing_a_server_moves_only_its_keys() -> None:
    nodes = [os.urandom(32) for _ in range(4)]
    before = homes(nodes)
    after = homes(nodes[:2] + nodes[3:])  # the third gone
    for a, b in zip(before, after, strict=True):
        if a != 2:
            assert b == (a if a < 2 else a - 1)


def test_the_order_servers_are_listed_in_decides_nothing() -> None:
    nodes = [os.urandom(32) for _ in range(3)]
    ordered = homes(nodes)
    backwards = homes(nodes[::-1])
    assert [nodes[h] for h in ordered] == [nodes[::-1][h] for h in backwards]


def test_a_rules_limits_and_caps_share_a_home_per_client() -> None:
    # Every limit and concurrency cap of one rule and one level key: one home key.
    assert counter_home_key("rl\x1fapi\x1fsecond\x1fclient:1") == counter_home_key(
        "rl\x1fapi\x1fminute\x1fclient:1"
    )
    assert counter_home_key("rl\x1fapi\x1fin-flight\x1fclient:1") == "rl\x1fapi\x1fclient:1"
    assert counter_home_key("rl\x1fapi\x1fminute\x1f") != counter_home_key(
        "rl\x1fother\x1fminute\x1f"
    )
    assert counter_home_key("anything") == "anything"
    # Every response of a caller scope (or an idempotent function): one home key.
    assert response_home_key("cred:abc\x1fkey-1") == response_home_key("cred:abc\x1fkey-2")
    assert response_home_key("\x1ffn:charge\x1f42") == "\x1ffn:charge"
    assert response_home_key("bare") == "bare"


def test_a_sharded_store_holds_stores_of_one_network_kind(tmp_path: object) -> None:
    pytest.importorskip("asyncpg")
    pytest.importorskip("redis")
    with pytest.raises(ConfigurationError, match="of one kind"):
        ShardedStore([open_store("postgresql://a/p"), open_store("redis://b:6379")])
    with pytest.raises(ConfigurationError, match="all be PostgreSQL or all Redis"):
        open_store(["postgresql://a/p", "redis://b:6379"])
    with pytest.raises(ConfigurationError, match="SQLite is one host's"):
        ShardedStore([SQLiteStore(directory=f"{tmp_path}/a")])
    one = open_store("postgresql://a/p")
    with pytest.raises(ConfigurationError, match="same store twice"):
        ShardedStore([one, one])
    with pytest.raises(ConfigurationError, match="at least one"):
        ShardedStore([])
    with pytest.raises(ConfigurationError, match="previous"):
        ShardedStore([one], previous=[open_store("postgresql://c/p")])
    # One URL is that store; several, a sharded store over them.
    assert not isinstance(open_store(["postgresql://a/p"]), ShardedStore)
    both = open_store(["postgresql://a/p", "postgresql://b/p"])
    assert isinstance(both, ShardedStore)
    assert len(both.stores) == 2


def test_previous_servers_are_named_by_their_urls() -> None:
    """open_store(urls, previous=[...]) and the demo's --previous-store: the old servers,
    each one of the URLs."""
    pytest.importorskip("asyncpg")
    from porch.demo.config import DemoConfig

    urls = ["postgresql://a/p", "postgresql://b/p", "postgresql://c/p"]
    store = open_store(urls, previous=urls[:2])
    assert isinstance(store, ShardedStore)
    assert store.previous == tuple(store.stores[:2])
    with pytest.raises(ConfigurationError, match="not among the URLs"):
        open_store(urls[:2], previous=["postgresql://d/p"])
    with pytest.raises(ConfigurationError, match="for several store URLs"):
        open_store(urls[0], previous=urls[:1])
    demo = DemoConfig(store=tuple(urls), previous_store=tuple(urls[:2])).open_store()
    assert isinstance(demo, ShardedStore)
    assert len(demo.previous) == 2
    with pytest.raises(ConfigurationError, match="--previous-store needs"):
        DemoConfig(store=urls[0], previous_store=(urls[0],)).open_store()


def test_its_capabilities_are_what_every_store_offers() -> None:
    pytest.importorskip("asyncpg")
    store = open_store(["postgresql://a/p", "postgresql://b/p"])
    assert isinstance(store, ShardedStore)
    child = store.stores[0].capabilities
    mine = store.capabilities
    assert mine.algorithms == child.algorithms
    assert (mine.slots, mine.slot_lease, mine.in_flight) == (True, child.slot_lease, 4)
    assert mine.apply_now is None
    assert mine.apply_then is None
    assert mine.parts is not None
    assert child.parts is not None
    assert mine.parts.part_bytes == child.parts.part_bytes
