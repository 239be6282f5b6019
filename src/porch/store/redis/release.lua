-- End a claim without storing. KEYS[1]: the record. ARGV[1]: token, ARGV[2]: channel,
-- ARGV[3]: the key as waiters know it. Returns 1, or 0 if the token is not current.
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
  return 0
end
if redis.call('HEXISTS', KEYS[1], 'd') == 1 then
  redis.call('HSET', KEYS[1], 'o', '0')
else
  redis.call('DEL', KEYS[1])
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
