#!lua flags=allow-oom
-- KEYS: subscriber hash, its queue, its queue's counters, pollers index, buffered total;
-- ARGV: id, pollers member. Returns the removed record or false.
local v = redis.call('HGET', KEYS[1], ARGV[1])
release(KEYS[5], tonumber(redis.call('HGET', KEYS[3], 'b') or '0'))
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('ZREM', KEYS[4], ARGV[2])
if not v then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
return v
