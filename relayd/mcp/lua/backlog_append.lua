#!lua
-- KEYS: backlog, buffered total; ARGV: frame, cap.
local cap = tonumber(ARGV[2])
local n = redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('INCRBY', KEYS[2], #ARGV[1])
while n > cap do
  release(KEYS[2], #redis.call('LPOP', KEYS[1]))
  n = n - 1
end
return 1
