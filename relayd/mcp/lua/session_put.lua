#!lua
-- KEYS: session hash, sessions index[, the sessions its client address registered];
-- ARGV: id, token hash, last seen[, ms to keep that address's set after this register].
redis.call('HSET', KEYS[1], 'h', ARGV[2], 't', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
if KEYS[3] then
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ARGV[4])
end
return 1
