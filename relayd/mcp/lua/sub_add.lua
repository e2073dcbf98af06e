#!lua
-- KEYS: subscriber hash, the session's arrival counter, pollers index;
-- ARGV: id, kind, label, has label ('0'/'1'), instance, last seen ms, pollers member.
local label = ARGV[3]
if ARGV[4] == '0' then label = false end
local seen = tonumber(ARGV[6])
local seq = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode({ARGV[2], label, ARGV[5], seen, 0, seq}))
if ARGV[2] == 'poll' then
  redis.call('ZADD', KEYS[3], seen, ARGV[7])
else
  redis.call('ZREM', KEYS[3], ARGV[7])
end
return 1
