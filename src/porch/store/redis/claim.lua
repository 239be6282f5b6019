-- Take an idempotency key for a holder, or return its stored response.
-- KEYS[1]: the key's record (a hash); with a quota, then the zset and sizes of the
-- caller's scope, its client and the whole store (see _quota.lua): on a Redis Cluster,
-- of its scope only (the other two are in other slots: the store takes them after).
-- ARGV: lease (ms); with a quota: bytes to reserve, scope cap, client cap, total cap.
-- Record fields: o = current owner token ('0' none), l = lease end (server ms),
-- t = last token issued, d/s/h/b = stored digest/status/headers/body,
-- w = '1' once someone found the claim held (only then do Save/Release publish).
-- Returns {0, ms_until_lease_end} (held), {1, d, s, h, b} (stored), {2, token},
-- {3, cap} (the reservation would pass cap 1 scope, 2 client, 3 total: nothing taken).
--#include _quota.lua
local rec = KEYS[1]
local v = redis.call('HMGET', rec, 'o', 'l', 'd', 's', 'h', 'b', 't')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if v[1] and v[1] ~= '0' and tonumber(v[2]) > now then
  redis.call('HSET', rec, 'w', '1')
  return {0, tonumber(v[2]) - now}
end
if v[3] then
  return {1, v[3], v[4], v[5], v[6]}
end
local lease = tonumber(ARGV[1])
local reserve = tonumber(ARGV[2] or '0')
if reserve > 0 then
  -- The reservation must fit every cap (live bytes; this key's own old entry, a dead
  -- holder's, is replaced), or nothing is taken.
  local books = (#KEYS - 1) / 2
  for b = 1, books do
    local all, own = used(KEYS[2 * b], KEYS[2 * b + 1], now, rec)
    if all - own + reserve > tonumber(ARGV[2 + b]) then
      return {3, b}
    end
  end
  for b = 1, books do
    put(KEYS[2 * b], KEYS[2 * b + 1], rec, reserve, now + lease, math.max(2 * lease, 60000))
  end
end
-- Fence tokens: above the last one issued, and above the server's time in
-- microseconds, so they keep rising after the record expired.
local token = math.max(tonumber(v[7] or '0') + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
local tok = string.format('%.0f', token)
redis.call('HSET', rec, 'o', tok, 'l', now + lease, 't', tok)
-- The record outlives its lease: a holder whose heartbeat came late, with
-- nobody taking the key meanwhile, still owns it and saves (a record gone with its lease
-- fenced that save, and the next duplicate ran the handler again). Whether a claim is
-- live is its lease end, 'l', never whether the record exists.
redis.call('PEXPIRE', rec, math.max(2 * lease, 60000))
return {2, tok}
