#!lua flags=allow-oom
-- KEYS: backlog, buffered total. Returns the frames.
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local size = 0
for _, f in ipairs(items) do size = size + #f end
release(KEYS[2], size)
redis.call('DEL', KEYS[1])
return items
