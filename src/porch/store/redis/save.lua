-- Store an owner's response, fenced by its token, within byte quotas; end the claim.
-- KEYS: record, scope expiries (zset), scope sizes (hash), total expiries, total sizes.
-- ARGV: token ('0': no claim), digest, status, headers, body, ttl (ms),
--       scope cap, total cap (bytes), channel, key as waiters know it.
-- Returns 'saved', 'fenced' or 'quota'.
local rec = KEYS[1]
local token = ARGV[1]
if token ~= '0' and redis.call('HGET', rec, 'o') ~= token then
  return 'fenced'
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key = ARGV[10]
-- Only a claim someone found held has waiters to wake (on any host).
local waited = redis.call('HGET', rec, 'w') == '1'

-- Live bytes only: entries whose expiry passed leave the sum (a bounded number per
-- call; anything left over is trimmed by the next save, counting until then).
local function used(zset, sizes)
  local gone = redis.call('ZRANGEBYSCORE', zset, '-inf', now, 'LIMIT', 0, 256)
  if #gone > 0 then
    local freed = 0
    for _, s in ipairs(redis.call('HMGET', sizes, unpack(gone))) do
      if s then freed = freed + tonumber(s) end
    end
    redis.call('HDEL', sizes, unpack(gone))
    redis.call('ZREM', zset, unpack(gone))
    if freed > 0 then redis.call('HINCRBY', sizes, '\0', -freed) end
  end
  return tonumber(redis.call('HGET', sizes, '\0') or '0'),
         tonumber(redis.call('HGET', sizes, key) or '0')
end

local size = #ARGV[2] + #ARGV[3] + #ARGV[4] + #ARGV[5]
local scope_used, scope_old = used(KEYS[2], KEYS[3])
local total_used, total_old = used(KEYS[4], KEYS[5])
if scope_used - scope_old + size > tonumber(ARGV[7])
    or total_used - total_old + size > tonumber(ARGV[8]) then
  if token ~= '0' then
    if redis.call('HEXISTS', rec, 'd') == 1 then
      redis.call('HSET', rec, 'o', '0')
      redis.call('HDEL', rec, 'w')
    else
      redis.call('DEL', rec)
    end
    if waited then redis.call('PUBLISH', ARGV[9], key) end
  end
  return 'quota'
end
local ttl = tonumber(ARGV[6])
local expires = now + ttl
redis.call('HSET', rec, 'o', '0', 'd', ARGV[2], 's', ARGV[3], 'h', ARGV[4], 'b', ARGV[5])
redis.call('HDEL', rec, 'w')
if token ~= '0' then redis.call('HSET', rec, 't', token) end
redis.call('PEXPIRE', rec, ttl)
for _, pair in ipairs({{KEYS[2], KEYS[3], scope_old}, {KEYS[4], KEYS[5], total_old}}) do
  redis.call('ZADD', pair[1], expires, key)
  redis.call('HSET', pair[2], key, size)
  redis.call('HINCRBY', pair[2], '\0', size - pair[3])
  -- The bookkeeping lives as long as its longest entry.
  if redis.call('PTTL', pair[1]) < ttl then
    redis.call('PEXPIRE', pair[1], ttl)
    redis.call('PEXPIRE', pair[2], ttl)
  end
end
if waited then redis.call('PUBLISH', ARGV[9], key) end
return 'saved'
