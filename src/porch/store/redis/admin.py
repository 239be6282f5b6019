"""The admin protocol on Redis: SCAN over this store's prefix, the server's clock.

Counters and stored responses are Redis keys with expiries, so Redis deletes
them itself when their time is up: ``purge`` trims what Redis cannot — the
expired entries of the byte-quota bookkeeping — atomically per caller scope
(one script), as the store's own saves do. ``check`` pings the server and
verifies, per scope and for the store, that the kept byte total equals the sum
of its entries (one script each, so a concurrent save cannot skew it).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from ...clock import Clock
from ...errors import StoreError
from ..admin import US, CheckReport, CounterInfo, PurgeReport, ResponseInfo, split_counter_key
from ..urls import redact
from .keys import KeyNames
from .scripts import library

__all__ = ["RedisAdmin"]

# Trim a bucket's expired entries, as the scripts do (the reservations of claims still
# held stay): KEYS zset, sizes; returns how many went.
_TRIM = (
    library("_quota.lua").decode()
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local before = redis.call('ZCARD', KEYS[1])
while redis.call('ZCOUNT', KEYS[1], '-inf', now) > 0 do
  used(KEYS[1], KEYS[2], now, '')
end
return before - redis.call('ZCARD', KEYS[1])
"""
)

# The same for a Redis Cluster's book in a slot of its own (a client's, the store's): its
# members name records in other slots, so a lapsed entry goes without reading its record
# (a claim still held is scored again by its heartbeat).
_TRIM_APART = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
local freed = 0
for _, m in ipairs(gone) do
  local size = redis.call('HGET', KEYS[2], m)
  if size then freed = freed + tonumber(size) end
  redis.call('HDEL', KEYS[2], m)
  redis.call('ZREM', KEYS[1], m)
end
if freed > 0 then redis.call('HINCRBY', KEYS[2], '\\0', -freed) end
return #gone
"""

# A scope's kept total and the sum of its entries, read atomically.
_SUMS = """
local total = tonumber(redis.call('HGET', KEYS[1], '\\0') or '0')
local sum = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= '\\0' then sum = sum + tonumber(all[i + 1]) end
end
return {total, sum}
"""

# Forget one stored response: its fields leave the record (whose fence token and any claim
# held stay), and its bytes leave the scope's and the store's quota bookkeeping.
# KEYS: record, scope expiries, scope sizes, total expiries, total sizes (on a Redis
# Cluster: the record and its scope's pair if in its slot; the rest lapse). ARGV: the key.
_FORGET = """
if redis.call('HEXISTS', KEYS[1], 's') == 0 then return 0 end
redis.call('HDEL', KEYS[1], 'd', 's', 'h', 'b')
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('DEL', KEYS[1]) end
local books = {}
for b = 1, (#KEYS - 1) / 2 do books[b] = {KEYS[2 * b], KEYS[2 * b + 1]} end
for _, pair in ipairs(books) do
  local size = redis.call('HGET', pair[2], ARGV[1])
  if size then
    redis.call('HDEL', pair[2], ARGV[1])
    redis.call('ZREM', pair[1], ARGV[1])
    redis.call('HINCRBY', pair[2], '\\0', -tonumber(size))
  end
end
return 1
"""
_GLOB = re.compile(r"([*?\[\]\\])")


class RedisAdmin:
    """:class:`~porch.store.admin.StoreAdmin` for one Redis store (one prefix)."""

    def __init__(
        self,
        connect: Callable[[int], Any],
        close: Callable[[Any], Awaitable[None]],
        names: KeyNames,
        location: str,
        clock: Clock | None = None,
    ) -> None:
        self._connect = connect  # a new client of the store's server, as the store's
        # Closes a client and its pool's connections (the pool is the client's own, which
        # redis-py's aclose() leaves open), bounded: as the store closes its clients.
        self._close = close
        self.names = names
        self.prefix = names.prefix
        self.location = location
        self._client: Any = None
        self._clock = clock  # the store's test clock, which its counters are on (or None)

    async def _redis(self) -> Any:
        if self._client is None:
            client: Any = self._connect(2)  # redis-py 7 types ping() as a union
            try:
                await client.ping()
            except Exception as exc:
                await self._close(client)
                raise StoreError(redact(f"{self.location}: {exc}")) from exc
            self._client = client
        return self._client

    def _match(self, kind: str) -> str:
        return _GLOB.sub(r"\\\1", self.prefix) + f":{kind}:*"

    def _logical(self, name: bytes, kind: str) -> str:
        text = name.decode("utf-8", "surrogatepass")[len(self.prefix) + len(kind) + 2 :]
        return text[text.index("}:") + 2 :] if text.startswith("{") and "}:" in text else text

    async def _scan(self, kind: str) -> list[bytes]:
        client = await self._redis()
        try:
            return [name async for name in client.scan_iter(match=self._match(kind), count=1000)]
        except Exception as exc:
            raise StoreError(redact(f"{self.location}: {exc}")) from exc

    async def counters(self, *, client: str | None = None, most: int = 1000) -> list[CounterInfo]:
        redis = await self._redis()
        chosen: list[tuple[bytes, tuple[str, str, str]]] = []
        for name in await self._scan("k"):
            parts = split_counter_key(self._logical(name, "k"))
            if parts is not None and (client is None or parts[2] == client):
                chosen.append((name, parts))
        chosen.sort(key=lambda item: item[0])
        chosen = chosen[:most]
        try:
            if self._clock is None:
                seconds, micros = await redis.time()
                now = seconds + micros / 1e6
            else:
                now = self._clock.monotonic()
            async with redis.pipeline(transaction=False) as pipe:
                for name, _ in chosen:
                    pipe.hmget(name, "n", "e")
                values = await pipe.execute()
        except Exception as exc:
            raise StoreError(redact(f"{self.location}: {exc}")) from exc
        found = []
        for (_, parts), (count, expires) in zip(chosen, values, strict=True):
            # A counter's own expiry decides (the key's TTL only bounds it), and what it
            # holds is a count (gcra's buckets hold a time: shown as none, as PostgreSQL).
            if count is None or expires is None or float(expires) <= now or int(count) <= 0:
                continue
            left = float(expires) - now
            found.append(CounterInfo(parts[2], parts[0], parts[1], int(count), left))
        return found

    async def responses(self, *, client: str | None = None, most: int = 1000) -> list[ResponseInfo]:
        redis = await self._redis()
        chosen = []
        for name in await self._scan("r"):
            key = self._logical(name, "r")
            scope, _, bare = key.partition(US)
            if client is None or scope == f"client:{client}":
                chosen.append((name, scope, bare))
        chosen.sort()
        try:
            seconds, micros = await redis.time()
            now = seconds + micros / 1e6
            async with redis.pipeline(transaction=False) as pipe:
                for name, _, _ in chosen:
                    pipe.hget(name, "s")
                    pipe.pttl(name)
                    for field in ("d", "h", "b"):
                        pipe.hstrlen(name, field)
                values = await pipe.execute()
        except Exception as exc:
            raise StoreError(redact(f"{self.location}: {exc}")) from exc
        found: list[ResponseInfo] = []
        for i, (name, scope, bare) in enumerate(chosen):
            status, ttl, *sizes = values[5 * i : 5 * i + 5]
            if status is None or ttl is None or ttl <= 0:
                continue  # a claim without a stored response, or gone
            size = len(name) + sum(sizes)
            found.append(ResponseInfo(scope, bare, int(status), size, ttl / 1000, now + ttl / 1000))
            if len(found) >= most:
                break
        return found

    async def reset(self, *, client: str, rule: str | None = None) -> int:
        redis = await self._redis()
        doomed = []
        for name in await self._scan("k"):
            parts = split_counter_key(self._logical(name, "k"))
            if parts is not None and parts[2] == client and (rule is None or parts[0] == rule):
                doomed.append(name)
        if not doomed:
            return 0
        try:
            return int(await redis.delete(*doomed))
        except Exception as exc:
            raise StoreError(redact(f"{self.location}: {exc}")) from exc

    def _pairs(self, zsets: list[bytes]) -> list[tuple[bytes, bytes]]:
        """Each quota bucket's (zset, sizes): scopes and the total (``qz``/``qb``), or
        clients (``qcz``/``qcb``), whichever ``zsets`` holds."""
        pairs = []
        for zset in zsets:
            for marker, sizes in ((b"qz:", b"qb:"), (b"qcz:", b"qcb:")):
                head = self.prefix.encode() + b":" + marker
                if zset.startswith(head):
                    pairs.append((zset, self.prefix.encode() + b":" + sizes + zset[len(head) :]))
        return pairs

    async def forget(self, *, scope: str, key: str) -> int:
        redis = await self._redis()
        logical = scope + US + key
        zset, sizes = self.names.scope(scope)
        keys = [
            self.names.record(logical),
            zset,
            sizes,
            self.names.total_zset,
            self.names.total_sizes,
        ]
        if self.names.cluster:
            # One slot per script: the record's, with its scope's books if they are there.
            keys = keys[:3] if self.names.same_slot(logical, scope) else keys[:1]
        try:
            forget = redis.register_script(_FORGET)
            done = await forget(keys=keys, args=[logical])
        except Exception as exc:
            raise StoreError(redact(f"{self.location}: {exc}")) from exc
        return int(done)

    async def purge(self) -> PurgeReport:
        redis = await self._redis()
        trim = redis.register_script(_TRIM)
        # A Cluster's books outside their records' slots (the client's, the store's) are
        # trimmed without reading the records.
        apart = redis.register_script(_TRIM_APART) if self.names.cluster else trim
        total_zset = self.names.total_zset
        trimmed = 0
        try:
            for zset, sizes in self._pairs(await self._scan("qz")):
                n = int(await (apart if zset == total_zset else trim)(keys=[zset, sizes]))
                if zset != total_zset:
                    trimmed += n
            for zset, sizes in self._pairs(await self._scan("qcz")):
                await apart(keys=[zset, sizes])  # the same responses, counted per client
        except Exception as exc:
            raise StoreError(redact(f"{self.location}: {exc}")) from exc
        # Counters and stored responses expire in Redis itself: nothing of theirs is left
        # to delete; what is reported is the quota bookkeeping of responses gone.
        return PurgeReport(0, trimmed)

    async def check(self) -> CheckReport:
        problems: list[str] = []
        try:
            redis = await self._redis()
            sums = redis.register_script(_SUMS)
            for _, sizes in self._pairs(await self._scan("qz") + await self._scan("qcz")):
                total, summed = await sums(keys=[sizes])
                if int(total) != int(summed):
                    scope = sizes.decode("utf-8", "replace")
                    problems.append(f"byte total {total} != {summed} in {scope}")
        except StoreError as exc:
            problems.append(str(exc))
        except Exception as exc:
            problems.append(redact(f"{self.location}: {exc}"))
        return CheckReport(self.location, 1, 1, tuple(problems))

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await self._close(client)
