-- A body streamed in parts is complete: keep it ARGV[3] ms (past its record's expiry).
-- KEYS[1]: the body. ARGV: its part count, its bytes in all. Returns 1, or 0 (nothing
-- changed) if it does not have exactly those parts and bytes: no record may name it.
local count = tonumber(ARGV[1])
if redis.call('HLEN', KEYS[1]) ~= count then
  return 0
end
local total = 0
for i = 0, count - 1 do
  if redis.call('HEXISTS', KEYS[1], tostring(i)) == 0 then
    return 0
  end
  total = total + redis.call('HSTRLEN', KEYS[1], tostring(i))
end
if total ~= tonumber(ARGV[2]) then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
