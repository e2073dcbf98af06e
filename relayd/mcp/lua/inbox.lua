#!lua
-- A frame posted to a session, in one round trip: authenticate and touch the session, then (for a
-- request) look up whether its id is taken and, when the poster is labelled and it is not,
-- record who asked; then read the subscribers of the frame's direction.
-- KEYS: session hash, sessions index, correlations, correlation order, subscriber hash;
-- ARGV: id, token hash, now, request-id key or '', correlation value or '', correlation cap.
-- Returns {reason} when refused, else {false, taken (0/1), recorded (0/1), subscribers}.
local stored = redis.call('HGET', KEYS[1], 'h')
if not stored then return {'session_gone'} end
if stored ~= ARGV[2] then return {'invalid_token'} end
redis.call('HSET', KEYS[1], 't', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local taken, recorded = 0, 0
if ARGV[4] ~= '' then
  taken = redis.call('HEXISTS', KEYS[3], ARGV[4])
  if taken == 0 and ARGV[5] ~= '' then
    local c, co, cap = KEYS[3], KEYS[4], tonumber(ARGV[6])
    redis.call('HSET', c, ARGV[4], ARGV[5])
    local newest = redis.call('ZRANGE', co, -1, -1, 'WITHSCORES')
    local score = 1
    if #newest > 0 then score = tonumber(newest[2]) + 1 end
    redis.call('ZADD', co, score, ARGV[4])
    while redis.call('ZCARD', co) > cap do
      local oldest = redis.call('ZPOPMIN', co)
      redis.call('HDEL', c, oldest[1])
    end
    recorded = 1
  end
end
return {false, taken, recorded, redis.call('HGETALL', KEYS[5])}
