#!lua flags=no-writes
-- KEYS: session hash, inbound and outbound subscriber hashes.
-- Returns {last seen or false (no such session), 1 when it has a reader else 0}.
local seen = redis.call('HGET', KEYS[1], 't')
local readers = redis.call('EXISTS', KEYS[2], KEYS[3])
if readers > 0 then readers = 1 end
return {seen, readers}
