#!lua
-- KEYS: subscriber hash, pollers index; ARGV: id, last seen ms or '', parked delta, pollers member.
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local r = cjson.decode(v)
if ARGV[2] ~= '' then r[4] = tonumber(ARGV[2]) end
r[5] = r[5] + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r))
if r[1] == 'poll' then redis.call('ZADD', KEYS[2], r[4], ARGV[4]) end
return 1
