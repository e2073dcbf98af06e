#!lua flags=no-writes
-- KEYS: inbound and outbound subscriber hashes.
return {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}
