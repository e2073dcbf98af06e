-- A replay, or one page of it, as one bulk string: the earliest member's position and arrival, the
-- next page's cursor (the last member's position and arrival, or nothing), then for each event its
-- position and arrival, and its bytes, one line each.
-- KEYS: the session's members (aep:s) and events (aep:e), the sessions being evicted
-- (aep:evicting); ARGV: the session, the lowest member (ZRANGEBYLEX form), the page size (0: all).
-- A member is '<position><arrival>\n<dedupe key>' (append.lua): only its first line is answered.
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then return '' end
local skey, ekey, low, limit = KEYS[1], KEYS[2], ARGV[2], tonumber(ARGV[3])
local find, sub = string.find, string.sub
local first = redis.call('ZRANGE', skey, 0, 0)
if #first == 0 then return '' end
local members
if limit > 0 then
  members = redis.call('ZRANGEBYLEX', skey, low, '+', 'LIMIT', 0, limit)
else
  members = redis.call('ZRANGEBYLEX', skey, low, '+')
end
local function line(member)
  return sub(member, 1, find(member, '\n', 1, true) - 1)
end
local cursor = ''
if limit > 0 and #members == limit then cursor = line(members[#members]) end
local out = {line(first[1]), cursor}
for _, m in ipairs(members) do
  local payload = redis.call('HGET', ekey, m)
  if payload then
    out[#out + 1] = line(m)
    out[#out + 1] = payload
  end
end
return table.concat(out, '\n')
