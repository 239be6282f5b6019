-- End a claim without storing. KEYS[1]: the record, then the zset and sizes of the
-- caller's scope, its client and the whole store (its reservation is freed there).
-- ARGV[1]: token, ARGV[2]: channel, ARGV[3]: the key as waiters know it, ARGV[4]: 'S'
-- to publish with SPUBLISH (a Cluster's channel in the record's slot), else PUBLISH.
-- Returns 1, or 0 if the token is not current.
--#include _quota.lua
local rec = KEYS[1]
if redis.call('HGET', rec, 'o') ~= ARGV[1] then
  return 0
end
local waited = redis.call('HGET', rec, 'w') == '1'
if redis.call('HEXISTS', rec, 'd') == 1 then
  redis.call('HSET', rec, 'o', '0')
  redis.call('HDEL', rec, 'w')
else
  redis.call('DEL', rec)
  for b = 1, (#KEYS - 1) / 2 do
    drop(KEYS[2 * b], KEYS[2 * b + 1], rec)
  end
end
-- Only a claim someone found held has waiters to wake (on any host).
if waited then
  redis.call(ARGV[4] == 'S' and 'SPUBLISH' or 'PUBLISH', ARGV[2], ARGV[3])
end
return 1
