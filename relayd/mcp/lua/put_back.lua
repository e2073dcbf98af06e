#!lua
-- KEYS: queue, its counters, buffered total; ARGV: frames, in order, to go back to the head.
for i = #ARGV, 1, -1 do
  redis.call('LPUSH', KEYS[1], ARGV[i])
  redis.call('HINCRBY', KEYS[2], 'b', #ARGV[i])
  redis.call('INCRBY', KEYS[3], #ARGV[i])
end
return 1
