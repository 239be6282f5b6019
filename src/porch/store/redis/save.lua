-- Store an owner's response, fenced by its token, within byte quotas; end the claim.
-- KEYS: record, then the zset and sizes of the caller's scope, its client and the
-- whole store (see _quota.lua); on a Redis Cluster, of its scope only (the store checks
-- the other two, in other slots, before).
-- ARGV: token ('0': no claim), digest, status, headers, body, ttl (ms),
--       scope cap, client cap, total cap (bytes), channel, key as waiters know it,
--       the response's size (bytes it counts against the quotas), 'S' to publish
--       with SPUBLISH (a Cluster's channel in the record's slot), else PUBLISH.
-- Returns 'saved', 'fenced' or 'quota'.
--#include _quota.lua
local rec = KEYS[1]
local token = ARGV[1]
if token ~= '0' and redis.call('HGET', rec, 'o') ~= token then
  return 'fenced'
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key = ARGV[11]
local publish = ARGV[13] == 'S' and 'SPUBLISH' or 'PUBLISH'
local books = (#KEYS - 1) / 2
-- Only a claim someone found held has waiters to wake (on any host).
local waited = redis.call('HGET', rec, 'w') == '1'

-- Live bytes only; this record's own entry (the claim's reservation, or an earlier
-- response) is replaced, so a response within its reservation always fits.
local size = tonumber(ARGV[12])
local over = false
for b = 1, books do
  local all, own = used(KEYS[2 * b], KEYS[2 * b + 1], now, rec)
  if all - own + size > tonumber(ARGV[6 + b]) then
    over = true
  end
end
if over then
  if token ~= '0' then
    if redis.call('HEXISTS', rec, 'd') == 1 then
      redis.call('HSET', rec, 'o', '0')
      redis.call('HDEL', rec, 'w')
    else
      redis.call('DEL', rec)
      for b = 1, books do
        drop(KEYS[2 * b], KEYS[2 * b + 1], rec)
      end
    end
    if waited then redis.call(publish, ARGV[10], key) end
  end
  return 'quota'
end
local ttl = tonumber(ARGV[6])
redis.call('HSET', rec, 'o', '0', 'd', ARGV[2], 's', ARGV[3], 'h', ARGV[4], 'b', ARGV[5])
redis.call('HDEL', rec, 'w')
if token ~= '0' then redis.call('HSET', rec, 't', token) end
redis.call('PEXPIRE', rec, ttl)
for b = 1, books do
  -- The bookkeeping lives as long as its longest entry.
  put(KEYS[2 * b], KEYS[2 * b + 1], rec, size, now + ttl, ttl)
end
if waited then redis.call(publish, ARGV[10], key) end
return 'saved'
