#!lua flags=allow-oom
-- Delete one receipt the per-agent cap let go, unless it is not settled (a pending plan or a
-- claim in flight stays). KEYS: receipt, lease. Returns 1 when it is gone (deleted, or expired
-- before), 0 when it stays.
local s = redis.call('HGET', KEYS[1], 's')
if not s then return 1 end
if (s ~= 'done' and s ~= 'spent') or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('DEL', KEYS[1])
return 1
