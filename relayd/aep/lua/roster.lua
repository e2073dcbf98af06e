#!lua flags=allow-oom
-- The claims of every claimed session; a session left without claims leaves the claimed set.
-- KEYS: the claimed set (aep:claimed), then each session's claims hash (aep:claims); ARGV: the
-- sessions, in the same order. Returns session, flat claims pairs, ...
local out = {}
for i = 1, #ARGV do
  local entries = redis.call('HGETALL', KEYS[i + 1])
  if #entries == 0 then
    redis.call('SREM', KEYS[1], ARGV[i])
  else
    out[#out + 1] = ARGV[i]
    out[#out + 1] = entries
  end
end
return out
