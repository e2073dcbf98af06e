#!lua flags=allow-oom
-- Give up a claim without a verdict. KEYS: receipt, lease; ARGV: lease token,
-- the settled channel (a channel is not a key).
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
if redis.call('HGET', KEYS[1], 's') == 'claimed' then redis.call('DEL', KEYS[1]) end
redis.call('PUBLISH', ARGV[2], KEYS[1])
return 1
