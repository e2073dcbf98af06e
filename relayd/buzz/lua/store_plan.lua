#!lua
-- Store the plan of a claimed request while its lease is still ours. KEYS: receipt, lease;
-- ARGV: digest, plan, lease token, retention s.
if redis.call('GET', KEYS[2]) ~= ARGV[3] then
  return redis.error_reply('LEASE the claim lapsed and another instance took it over')
end
redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', 'pending', 'p', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
