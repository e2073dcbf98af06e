#!lua
-- KEYS: session hash, sessions index; ARGV: id, presented token hash, now.
-- The stored and the presented token hashes are compared here (not in constant time): both are
-- SHA-256 digests, so timing reveals at most how many leading hex digits of two hashes agree,
-- which says nothing useful about a token.
local stored = redis.call('HGET', KEYS[1], 'h')
if not stored then return 'session_gone' end
if stored ~= ARGV[2] then return 'invalid_token' end
redis.call('HSET', KEYS[1], 't', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return false
