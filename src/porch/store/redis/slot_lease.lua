-- Heartbeat: extend a slot this process holds by ARGV[2] ms from now, or end it (0).
-- KEYS[1]: the slot key's sorted set. ARGV[1]: the token. Returns 1, or 0 if the slot
-- is gone or lapsed: a lapsed slot is never renewed (another request may hold its place).
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return 0
end
local lease = tonumber(ARGV[2])
if lease == 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(score) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[1])
if redis.call('PTTL', KEYS[1]) < lease then
  redis.call('PEXPIRE', KEYS[1], lease)
end
return 1
