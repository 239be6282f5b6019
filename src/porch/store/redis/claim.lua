-- Take an idempotency key for a holder, or return its stored response.
-- KEYS[1]: the key's record (a hash). ARGV[1]: lease (ms).
-- Record fields: o = current owner token ('0' none), l = lease end (server ms),
-- t = last token issued, d/s/h/b = stored digest/status/headers/body,
-- w = '1' once someone found the claim held (only then do Save/Release publish).
-- Returns {0, ms_until_lease_end} (held), {1, d, s, h, b} (stored), {2, token}.
local v = redis.call('HMGET', KEYS[1], 'o', 'l', 'd', 's', 'h', 'b', 't')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if v[1] and v[1] ~= '0' and tonumber(v[2]) > now then
  redis.call('HSET', KEYS[1], 'w', '1')
  return {0, tonumber(v[2]) - now}
end
if v[3] then
  return {1, v[3], v[4], v[5], v[6]}
end
-- Fence tokens: above the last one issued, and above the server's time in
-- microseconds, so they keep rising after the record expired (a lapsed claim's
-- record goes with its lease).
local token = math.max(tonumber(v[7] or '0') + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
local tok = string.format('%.0f', token)
local lease = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'o', tok, 'l', now + lease, 't', tok)
redis.call('PEXPIRE', KEYS[1], lease)
return {2, tok}
