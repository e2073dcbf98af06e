#!lua
-- KEYS: correlations, correlation order; ARGV: request-id key, value, cap, and 'claim' to record
-- only when the key is not pending. Returns 1 when recorded, 0 when a claimed key was taken.
local c, co, cap = KEYS[1], KEYS[2], tonumber(ARGV[3])
if ARGV[4] == 'claim' and redis.call('HEXISTS', c, ARGV[1]) == 1 then return 0 end
redis.call('HSET', c, ARGV[1], ARGV[2])
-- Insertion order within the session: one more than the newest (the oldest is evicted first).
local newest = redis.call('ZRANGE', co, -1, -1, 'WITHSCORES')
local score = 1
if #newest > 0 then score = tonumber(newest[2]) + 1 end
redis.call('ZADD', co, score, ARGV[1])
while redis.call('ZCARD', co) > cap do
  local oldest = redis.call('ZPOPMIN', co)
  redis.call('HDEL', c, oldest[1])
end
return 1
