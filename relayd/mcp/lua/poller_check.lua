#!lua flags=allow-oom
-- KEYS: pollers index, the poller's subscriber hash; ARGV: pollers member, id, stale ms.
-- An idle poller's record when it is not parked (or parked for longer than any poll lasts);
-- false otherwise. A member whose record is gone leaves the index.
local v = redis.call('HGET', KEYS[2], ARGV[2])
if not v then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return false
end
local r = cjson.decode(v)
if r[5] <= 0 or r[4] < tonumber(ARGV[3]) then return v end
return false
