-- Count m alike requests (one rule, one caller) against every limit of the rule,
-- in turn: the first k that fit under every limit are counted, on all limits or
-- none; the others are refused and consume nothing.
-- KEYS: one counter per limit (one hash tag: the rule and the caller).
-- ARGV: m, then amount and window (ms) per limit, in KEYS order.
-- Returns {k, now_ms, count_1 .. count_n (before them), reset_ms_1 .. reset_ms_n}.
-- Time is the server's TIME, so every app host decides on the same clock.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS
local k = tonumber(ARGV[1])
local counts, resets = {}, {}
for i = 1, n do
  local amount = tonumber(ARGV[2 * i])
  local count = tonumber(redis.call('GET', KEYS[i]) or '0')
  local ttl = redis.call('PTTL', KEYS[i])
  if count == 0 or ttl < 0 then
    -- A fresh window starts with these requests (nothing is written if all are refused).
    count = 0
    ttl = tonumber(ARGV[2 * i + 1])
  end
  if amount - count < k then
    k = math.max(amount - count, 0)
  end
  counts[i] = count
  resets[i] = ttl
end
if k > 0 then
  for i = 1, n do
    if counts[i] == 0 then
      -- The key's expiry is its window's end, on the server's clock.
      redis.call('SET', KEYS[i], k, 'PX', ARGV[2 * i + 1])
    else
      redis.call('INCRBY', KEYS[i], k)
    end
  end
end
local out = {k, now}
for i = 1, n do out[2 + i] = counts[i] end
for i = 1, n do out[2 + n + i] = resets[i] end
return out
