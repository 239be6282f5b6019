-- End a claim without storing. KEYS[1]: the record. ARGV[1]: token, ARGV[2]: channel,
-- ARGV[3]: the key as waiters know it. Returns 1, or 0 if the token is not current.
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
  return 0
end
local waited = redis.call('HGET', KEYS[1], 'w') == '1'
if redis.call('HEXISTS', KEYS[1], 'd') == 1 then
  redis.call('HSET', KEYS[1], 'o', '0')
  redis.call('HDEL', KEYS[1], 'w')
else
  redis.call('DEL', KEYS[1])
end
-- Only a claim someone found held has waiters to wake (on any host).
if waited then
  redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return 1
