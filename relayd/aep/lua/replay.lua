-- A replay, or one page of it, as one bulk string: the earliest member, the next page's cursor
-- (or nothing), then member and event lines.
-- KEYS: the session's members (aep:s) and events (aep:e), the sessions being evicted
-- (aep:evicting); ARGV: the session, the lowest member (ZRANGEBYLEX form), the page size (0: all).
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then return '' end
local skey, ekey, low, limit = KEYS[1], KEYS[2], ARGV[2], tonumber(ARGV[3])
local first = redis.call('ZRANGE', skey, 0, 0)
if #first == 0 then return '' end
local members
if limit > 0 then
  members = redis.call('ZRANGEBYLEX', skey, low, '+', 'LIMIT', 0, limit)
else
  members = redis.call('ZRANGEBYLEX', skey, low, '+')
end
local cursor = ''
if limit > 0 and #members == limit then cursor = members[#members] end
local out = {first[1], cursor}
for _, m in ipairs(members) do
  local payload = redis.call('HGET', ekey, m)
  if payload then
    out[#out + 1] = m
    out[#out + 1] = payload
  end
end
return table.concat(out, '\n')
