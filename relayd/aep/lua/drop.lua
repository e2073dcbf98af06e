#!lua flags=allow-oom
-- Drop the keys of a session append.lua evicted (unless a later append dropped them already).
-- KEYS: the sessions being evicted (aep:evicting), then the session's members, events, dedupe
-- keys and arrival counter; ARGV: the session.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
end
return 1
