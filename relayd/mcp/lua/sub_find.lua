#!lua flags=no-writes
-- KEYS: inbound and outbound subscriber hashes; ARGV: id. Returns direction, record pairs.
local out = {}
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v then out[#out + 1] = 'inbound'; out[#out + 1] = v end
v = redis.call('HGET', KEYS[2], ARGV[1])
if v then out[#out + 1] = 'outbound'; out[#out + 1] = v end
return out
