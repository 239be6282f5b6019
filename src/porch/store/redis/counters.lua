-- Decide m alike hits of one rule (the first k that fit every limit in turn are
-- counted, on all its limits or none: a refused hit writes nothing), or apply a
-- settle (m = 0), as docs/design.md ("Policies") states, in its double arithmetic
-- and order (Lua numbers are IEEE doubles; counts stay integral below 2^53).
-- KEYS: one counter per limit: a hash {a = algorithm (0 fixed, 1 sliding, 2 gcra),
--   n = count, p = previous count, s = window start or arrival time, e = expiry}.
--   A limit's level decides its key; on a standalone server one call touches them all.
-- ARGV: t ('' for the server's TIME; else a test clock's time), m, cost, then per
--   limit: algorithm, amount, window (s), burst, and for a settle delta and stamp.
--   m < 0: decide -m hits but write nothing (a Redis Cluster's first step of a hit
--   whose levels are in several slots: cluster.py).
-- Returns {k, t, then per limit n, p, s before the hits} ('%.17g' strings for the
-- times: exact); a settle returns {0, t}.
local EPS = 1e-9
local test = ARGV[1] ~= ''
local t
if test then
  t = tonumber(ARGV[1])
else
  local now = redis.call('TIME')
  t = tonumber(now[1]) + tonumber(now[2]) / 1000000
end
local m = tonumber(ARGV[2])
local probe = m < 0
if probe then m = -m end
local cost = tonumber(ARGV[3])
local stride = m == 0 and 6 or 4
local L = #KEYS

local function fmt(x)
  return string.format('%.17g', x)
end

-- A row that is absent, expired or another algorithm's reads as absent; an elapsed
-- window rolls. Returns n, p, s and whether the row holds that state but for its count
-- (its start, previous count and expiry for this window kept: only n need be written).
local function read(key, tag, window)
  local v = redis.call('HMGET', key, 'a', 'n', 'p', 's', 'e')
  if not v[1] or tonumber(v[1]) ~= tag or t >= tonumber(v[5]) then
    return 0, 0, t, false
  end
  local n, p, s, e = tonumber(v[2]), tonumber(v[3]), tonumber(v[4]), tonumber(v[5])
  if tag == 0 then
    if t >= s + window then return 0, 0, t, false end
    return n, 0, s, e == s + window and p == 0
  elseif tag == 1 then
    if t >= s + 2 * window then return 0, 0, t, false end
    if t >= s + window then return 0, n, s + window, false end
    return n, p, s, e == s + 2 * window
  end
  if s > t then return 0, 0, s, false end
  return 0, 0, t, false
end

-- Write a state: the count alone when only it changed, else the whole row and its
-- expiry on the server (a bound for Redis to drop it by; the row's own e decides).
local function write(key, tag, window, n, p, s, kept)
  if kept then
    redis.call('HSET', key, 'n', n)
    return
  end
  local e
  if tag == 0 then e = s + window elseif tag == 1 then e = s + 2 * window else e = s end
  redis.call('HSET', key, 'a', tag, 'n', n, 'p', p, 's', fmt(s), 'e', fmt(e))
  local ttl = math.ceil((e - t) * 1000)
  -- A test clock is not the server's: its rows live ten minutes longer on the server,
  -- so they are gone only once the test's own time has read them as expired.
  if test then ttl = ttl + 600000 end
  if ttl > 0 then
    redis.call('PEXPIRE', key, ttl)
  else
    redis.call('DEL', key)  -- already expired (a gcra bucket full again)
  end
end

if m == 0 then
  for i = 1, L do
    local at = 3 + (i - 1) * stride
    local tag, amount, window = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
    local delta, stamp = tonumber(ARGV[at + 5]), tonumber(ARGV[at + 6])
    if delta ~= 0 then
      local n, p, s, kept = read(KEYS[i], tag, window)
      local act = true
      if tag == 2 then
        local T = window / amount
        if delta > 0 then
          s = s + delta * T
        elseif s > t then
          local tat = s + delta * T
          if tat > t then s = tat else s = t end
        else
          act = false  -- a refund to a full bucket
        end
        kept = false
      elseif s == stamp then
        n = math.max(0, n + delta)
      elseif tag == 1 and s == stamp + window then  -- now the previous window
        p = math.max(0, p + delta)
        kept = false
      elseif delta > 0 then  -- a debt follows the client into the current window
        n = n + delta
      else
        act = false  -- a refund to a window that has gone
      end
      if act then write(KEYS[i], tag, window, n, p, s, kept) end
    end
  end
  return {0, fmt(t)}
end

local k = m
local ns, ps, ss, kepts = {}, {}, {}, {}
for i = 1, L do
  local at = 3 + (i - 1) * stride
  local tag, amount, window = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
  local n, p, s, kept = read(KEYS[i], tag, window)
  ns[i], ps[i], ss[i], kepts[i] = n, p, s, kept
  if tag == 0 then  -- n + c <= A, n growing by c a hit
    if n + k * cost > amount then
      if cost == 0 then k = 0 else k = math.max(0, math.floor((amount - n) / cost)) end
    end
  elseif tag == 1 then  -- p * w + n + c <= A + EPS
    local pw = p * ((window - (t - s)) / window)
    local j = 0
    while j < k and pw + (n + j * cost) + cost <= amount + EPS do
      if cost == 0 then j = k else j = j + 1 end
    end
    k = j
  else  -- (tat - t) + c * T <= T * B + EPS * T, tat growing by c * T a hit
    local T = window / amount
    local burst = tonumber(ARGV[at + 4])
    local j = 0
    while j < k and (s - t) + cost * T <= T * burst + EPS * T do
      s = s + cost * T
      if cost == 0 then j = k else j = j + 1 end
    end
    k = j
  end
end
if k > 0 and not probe then
  for i = 1, L do
    local at = 3 + (i - 1) * stride
    local tag, amount, window = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
    local n, s = ns[i], ss[i]
    if tag == 2 then
      local T = window / amount
      for _ = 1, k do s = s + cost * T end
      write(KEYS[i], tag, window, 0, 0, s, false)
    else
      write(KEYS[i], tag, window, n + k * cost, ps[i], s, kepts[i])
    end
  end
end
local out = {k, fmt(t)}
for i = 1, L do
  out[#out + 1] = ns[i]
  out[#out + 1] = ps[i]
  out[#out + 1] = fmt(ss[i])
end
return out
