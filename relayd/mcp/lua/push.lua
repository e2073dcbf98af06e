#!lua
-- KEYS: queue, its counters, buffered total; ARGV: frame, max frames, max bytes.
-- Returns how many of the oldest frames were dropped to keep the queue within its bounds.
local q, m = KEYS[1], KEYS[2]
local item = ARGV[1]
local max_items, max_bytes = tonumber(ARGV[2]), tonumber(ARGV[3])
local n = redis.call('RPUSH', q, item)
local bytes = redis.call('HINCRBY', m, 'b', #item)
redis.call('INCRBY', KEYS[3], #item)
local dropped = 0
while n > 1 and (n > max_items or bytes > max_bytes) do
  local old = redis.call('LPOP', q)
  bytes = redis.call('HINCRBY', m, 'b', -#old)
  release(KEYS[3], #old)
  n = n - 1
  dropped = dropped + 1
end
if dropped > 0 then redis.call('HINCRBY', m, 'd', dropped) end
return dropped
