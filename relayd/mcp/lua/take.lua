#!lua flags=allow-oom
-- KEYS: queue, its counters, buffered total. Returns {frames, dropped since the last take}.
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local dropped = redis.call('HGET', KEYS[2], 'd')
release(KEYS[3], tonumber(redis.call('HGET', KEYS[2], 'b') or '0'))
redis.call('DEL', KEYS[1], KEYS[2])
return {items, tonumber(dropped or '0')}
