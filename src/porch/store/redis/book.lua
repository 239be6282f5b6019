-- A Redis Cluster store's byte-quota book in a slot of its own: a client's, or the whole
-- store's (the scope's book shares its records' slot and stays in the claim, save and
-- release scripts). The same sorted set and sizes hash as _quota.lua, but its members are
-- a record's name and a claim's token (keys.py, book_member), and a lapsed entry is
-- dropped without reading its record (another slot): a claim still held keeps its entry
-- alive because its heartbeat scores it again ('renew').
-- KEYS: the zset, the sizes. ARGV[1]: the step, ARGV[2]: the member, then
--   take: size (bytes), cap (bytes), until (ms from now), the book's least ttl (ms);
--   renew: the lease (ms), the entry's size (bytes). drop: nothing more.
-- Returns take: 1 (counted, replacing the member's earlier entry) or 0 (over the cap:
-- nothing changed); renew: 1 (an entry a late heartbeat found trimmed is put back: the
-- claim still holds those bytes); drop: 1.
local zset, sizes, step, member = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function drop(m)
  local old = redis.call('HGET', sizes, m)
  if old then
    redis.call('HDEL', sizes, m)
    redis.call('ZREM', zset, m)
    redis.call('HINCRBY', sizes, '\0', -tonumber(old))
  end
end

if step == 'drop' then
  drop(member)
  return 1
end
if step == 'renew' then
  local lease, size = tonumber(ARGV[3]), tonumber(ARGV[4])
  local own = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('ZADD', zset, now + lease, member)
  if own ~= size then
    redis.call('HSET', sizes, member, size)
    redis.call('HINCRBY', sizes, '\0', size - own)
  end
  if redis.call('PTTL', zset) < lease then
    redis.call('PEXPIRE', zset, lease)
    redis.call('PEXPIRE', sizes, lease)
  end
  return 1
end
-- take: lapsed entries leave the sum first (a bounded number per call), so only live
-- bytes count against the cap.
for _, m in ipairs(redis.call('ZRANGEBYSCORE', zset, '-inf', now, 'LIMIT', 0, 256)) do
  drop(m)
end
local size, cap = tonumber(ARGV[3]), tonumber(ARGV[4])
local all = tonumber(redis.call('HGET', sizes, '\0') or '0')
local own = tonumber(redis.call('HGET', sizes, member) or '0')
if all - own + size > cap then
  return 0
end
local ttl = tonumber(ARGV[6])
redis.call('ZADD', zset, now + tonumber(ARGV[5]), member)
redis.call('HSET', sizes, member, size)
redis.call('HINCRBY', sizes, '\0', size - own)
if redis.call('PTTL', zset) < ttl then
  redis.call('PEXPIRE', zset, ttl)
  redis.call('PEXPIRE', sizes, ttl)
end
return 1
