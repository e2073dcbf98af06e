#!lua
-- Store the verdict, drop our lease and tell the waiters. KEYS: receipt, lease; ARGV: digest,
-- verdict, lease token, retention s, '1' for a read page (kept as spent, without its verdict), the
-- settled channel (a channel is not a key).
local r = redis.call('HMGET', KEYS[1], 's', 'v')
if r[1] == 'done' then
  if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
  return r[2]
end
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', 'spent')
  redis.call('HDEL', KEYS[1], 'p', 'v')
else
  redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', 'done', 'v', ARGV[2])
  redis.call('HDEL', KEYS[1], 'p')
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
redis.call('PUBLISH', ARGV[6], KEYS[1])
return ARGV[2]
