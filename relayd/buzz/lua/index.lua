#!lua
-- Index a settled receipt under its agent for the per-agent cap (docs/decisions.md B-12).
-- KEYS: the agent's index (a sorted set: requestId by settle time); ARGV: settle time ms,
-- requestId, retention s, the cap. Returns the oldest requestIds past the cap, and a tenth of
-- the cap more (the caller deletes those that are settled), or nothing while under it.
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
local n = redis.call('ZCARD', KEYS[1])
local cap = tonumber(ARGV[4])
if n <= cap then return {} end
local excess = n - cap + math.max(1, math.floor(cap / 10))
return redis.call('ZRANGE', KEYS[1], 0, excess - 1)
