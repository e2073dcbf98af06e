#!lua
-- Claim a request: KEYS: receipt, lease; ARGV: request digest, lease token, lease ms, this
-- instance's token prefix, retention s. Returns {new}, {conflict}, {done, verdict}, {busy} or {resume, plan}.
local r = redis.call('HMGET', KEYS[1], 'd', 's', 'v', 'p')
local function take()
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
if not r[1] then
  redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', 'claimed')
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  take()
  return {'new'}
end
if r[1] ~= ARGV[1] then return {'conflict'} end
if r[2] == 'done' then return {'done', r[3]} end
local holder = redis.call('GET', KEYS[2])
if holder and string.sub(holder, 1, #ARGV[4]) ~= ARGV[4] then return {'busy'} end
take()
if r[2] == 'pending' then return {'resume', r[4]} end
return {'new'}
