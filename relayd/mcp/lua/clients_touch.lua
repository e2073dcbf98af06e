#!lua flags=allow-oom
-- KEYS: the client records (mcp:cl:<id>); ARGV[1]: idle ms. One flag per key: still there.
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('PEXPIRE', KEYS[i], ARGV[1])
end
return out
