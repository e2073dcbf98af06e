#!lua flags=allow-oom
-- KEYS: session hash, sessions index; ARGV: id.
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
