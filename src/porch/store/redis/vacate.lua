-- Free the slots of one request: its token in each slot key's sorted set.
-- KEYS: the slot keys' sets. ARGV[1]: the token. Returns how many it held.
local freed = 0
for i = 1, #KEYS do
  freed = freed + redis.call('ZREM', KEYS[i], ARGV[1])
end
return freed
