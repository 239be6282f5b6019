-- Heartbeat: extend a claim this process still holds.
-- KEYS[1]: the record. ARGV[1]: token, ARGV[2]: lease (ms). Returns 1, or 0 if lost.
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'l', now + lease)
if redis.call('HEXISTS', KEYS[1], 'd') == 0 then
  -- Past the lease, as claim.lua keeps it: a late renewal nobody preempted still holds.
  redis.call('PEXPIRE', KEYS[1], math.max(2 * lease, 60000))
end
return 1
