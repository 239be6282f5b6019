-- Count one request against every limit of a rule: all limits or none.
-- KEYS: one counter per limit (one hash tag: the rule and the caller).
-- ARGV: amount and window (ms) per limit, in KEYS order.
-- Returns {allowed, now_ms, count_1 .. count_n, reset_ms_1 .. reset_ms_n}.
-- Time is the server's TIME, so every app host decides on the same clock.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = #KEYS
local counts, resets = {}, {}
local allowed = 1
for i = 1, n do
  local amount = tonumber(ARGV[2 * i - 1])
  local count = tonumber(redis.call('GET', KEYS[i]) or '0')
  local ttl = redis.call('PTTL', KEYS[i])
  if count == 0 or ttl < 0 then
    -- A fresh window starts with this request (nothing is written if it is refused).
    count = 0
    ttl = tonumber(ARGV[2 * i])
  end
  if count >= amount then
    allowed = 0
  end
  counts[i] = count
  resets[i] = ttl
end
if allowed == 1 then
  for i = 1, n do
    if counts[i] == 0 then
      -- The key's expiry is its window's end, on the server's clock.
      redis.call('SET', KEYS[i], 1, 'PX', ARGV[2 * i])
    else
      redis.call('INCR', KEYS[i])
    end
    counts[i] = counts[i] + 1
  end
end
local out = {allowed, now}
for i = 1, n do out[2 + i] = counts[i] end
for i = 1, n do out[2 + n + i] = resets[i] end
return out
