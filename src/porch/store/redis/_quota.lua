-- The byte-quota bookkeeping, included by the scripts that touch it (claim, save,
-- release). A bucket (a caller scope, a client, or the whole store) is a sorted set
-- and a hash: members are records' Redis names, scored by when their bytes stop
-- counting (a stored response's expiry, a claim's lease end); the hash holds each
-- member's size and the running sum under '\0'.

-- The bucket's live bytes, and the member's own share of them. Entries whose score
-- passed leave the sum (a bounded number per call; the rest go with the next call),
-- except the reservation of a claim still held: its lease was renewed since it was
-- scored, so it is scored again at the lease's new end.
local function used(zset, sizes, now, member)
  local gone = redis.call('ZRANGEBYSCORE', zset, '-inf', now, 'LIMIT', 0, 256)
  if #gone > 0 then
    local drop = {}
    for _, m in ipairs(gone) do
      local f = redis.call('HMGET', m, 'o', 'l', 'd')
      if f[1] and f[1] ~= '0' and not f[3] and tonumber(f[2]) > now then
        redis.call('ZADD', zset, tonumber(f[2]), m)
      else
        drop[#drop + 1] = m
      end
    end
    if #drop > 0 then
      local freed = 0
      for _, s in ipairs(redis.call('HMGET', sizes, unpack(drop))) do
        if s then freed = freed + tonumber(s) end
      end
      redis.call('HDEL', sizes, unpack(drop))
      redis.call('ZREM', zset, unpack(drop))
      if freed > 0 then redis.call('HINCRBY', sizes, '\0', -freed) end
    end
  end
  return tonumber(redis.call('HGET', sizes, '\0') or '0'),
         tonumber(redis.call('HGET', sizes, member) or '0')
end

-- Count ``size`` bytes for the member until ``score`` (replacing its earlier entry);
-- the bookkeeping lives at least ``ttl`` ms.
local function put(zset, sizes, member, size, score, ttl)
  local old = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('ZADD', zset, score, member)
  redis.call('HSET', sizes, member, size)
  redis.call('HINCRBY', sizes, '\0', size - old)
  if redis.call('PTTL', zset) < ttl then
    redis.call('PEXPIRE', zset, ttl)
    redis.call('PEXPIRE', sizes, ttl)
  end
end

-- The member's bytes stop counting now.
local function drop(zset, sizes, member)
  local old = redis.call('HGET', sizes, member)
  if old then
    redis.call('HDEL', sizes, member)
    redis.call('ZREM', zset, member)
    redis.call('HINCRBY', sizes, '\0', -tonumber(old))
  end
end
