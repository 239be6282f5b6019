-- Keep one part of a body streamed to the store (parts.py). KEYS[1]: the body, a hash of
-- part index -> bytes. ARGV: the index, the bytes, how long the body lives past this part
-- (ms): a body no record will name goes on its own. Returns 1.
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
