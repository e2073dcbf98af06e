#!lua
-- KEYS: session hash, sessions index; ARGV: id, token hash, last seen.
redis.call('HSET', KEYS[1], 'h', ARGV[2], 't', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
