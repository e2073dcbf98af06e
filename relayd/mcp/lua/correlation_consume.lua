#!lua flags=allow-oom
-- KEYS: correlations, correlation order; ARGV: request-id key. Returns the value or false.
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return v
