#!lua
-- A frame the page posts, in one round trip: authenticate and touch the session, then (for a
-- response) consume the correlation of its id, then read both directions' subscribers.
-- KEYS: session hash, sessions index, correlations, correlation order, inbound and outbound
-- subscriber hashes; ARGV: id, token hash, now, response-id key or ''.
-- Returns {reason} when refused, else {false, correlation or false, inbound, outbound}.
local stored = redis.call('HGET', KEYS[1], 'h')
if not stored then return {'session_gone'} end
if stored ~= ARGV[2] then return {'invalid_token'} end
redis.call('HSET', KEYS[1], 't', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local correlation = false
if ARGV[4] ~= '' then
  correlation = redis.call('HGET', KEYS[3], ARGV[4])
  if correlation then
    redis.call('HDEL', KEYS[3], ARGV[4])
    redis.call('ZREM', KEYS[4], ARGV[4])
  end
end
return {false, correlation, redis.call('HGETALL', KEYS[5]), redis.call('HGETALL', KEYS[6])}
