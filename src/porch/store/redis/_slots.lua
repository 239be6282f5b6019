-- Concurrency slots (docs/design.md, "Slots"), put around counters.lua to make the
-- script slot_hits (scripts.py): a hit is capped at the free slots before its limits
-- are read (a request without a slot consumes no rate), and the hits its limits let
-- through take a slot of each key after (a request a rate limit refuses takes none).
-- KEYS: the counters, then one sorted set per slot key: a member per request in flight,
--   its token, scored by its lease's end (server ms); '#seq' scored minus the last
--   token given there (so tokens never repeat in a set while it lives).
-- ARGV: the counters', then the first token (0: the next of these sets; a Redis
--   Cluster's hit whose slot keys are in several slots gives them all one), lease (ms),
--   one cap per slot key, the number of slot keys.
-- Adds to the reply, per slot key, the requests in flight before the hits, then the
-- first of their tokens (0: none taken; a probe: the next token these sets would give;
-- -1: the first token given could not be used, a set gave a later one: none taken).
local SLOTS = tonumber(ARGV[#ARGV])
local slot_lease = tonumber(ARGV[#ARGV - SLOTS - 1])
local slot_first = tonumber(ARGV[#ARGV - SLOTS - 2])
local slot_now
do
  local now = redis.call('TIME')
  slot_now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
local slot_used = {}

local function slot_key(i)
  return KEYS[#KEYS - SLOTS + i]
end

-- How many of m alike hits find a free slot under every slot key: its live members
-- (lapsed ones are deleted here).
local function admit(m)
  local k = m
  for i = 1, SLOTS do
    local key = slot_key(i)
    redis.call('ZREMRANGEBYSCORE', key, 0, slot_now)
    local used = redis.call('ZCOUNT', key, '(' .. slot_now, '+inf')
    slot_used[i] = used
    local cap = tonumber(ARGV[#ARGV - SLOTS - 1 + i])
    if cap - used < k then k = math.max(0, cap - used) end
  end
  return k
end

-- The slots of the k hits let through: tokens after the last one any of the sets saw.
local function last_token()
  local last = 0
  for i = 1, SLOTS do
    local seq = redis.call('ZSCORE', slot_key(i), '#seq')
    if seq and -tonumber(seq) > last then last = -tonumber(seq) end
  end
  return last
end

local function admitted(k, out, probe)
  for i = 1, SLOTS do out[#out + 1] = slot_used[i] end
  local first = 0
  if probe then
    out[#out + 1] = last_token() + 1
    return
  end
  if SLOTS > 0 and k > 0 then
    first = last_token() + 1
    if slot_first > 0 then
      if first > slot_first then
        out[#out + 1] = -1
        return
      end
      first = slot_first
    end
    local last = first + k - 1
    for i = 1, SLOTS do
      local key = slot_key(i)
      local args = {-last, '#seq'}
      for token = first, last do
        args[#args + 1] = slot_now + slot_lease
        args[#args + 1] = string.format('%d', token)
      end
      redis.call('ZADD', key, unpack(args))
      if redis.call('PTTL', key) < slot_lease then redis.call('PEXPIRE', key, slot_lease) end
    end
  end
  out[#out + 1] = first
end
