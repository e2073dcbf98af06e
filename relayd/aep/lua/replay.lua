-- A replay, or one page of it, as one bulk string: the earliest member's position and arrival, the
-- next page's cursor (the last member's position and arrival, or nothing), then for each event its
-- position and arrival, and its bytes, one line each.
-- KEYS: the session's members (aep:s) and events (aep:e), the sessions being evicted
-- (aep:evicting); ARGV: the session, the lowest member (ZRANGEBYLEX form), the page size (0: all).
-- A member is '<position><arrival>\n<id>\n<dedupe key>' (append.lua): <id> is empty for an event
-- stored alone under its arrival, else the arrival under which its batch's message is stored
-- (after a header whose length is under 'h' .. id): the event is its line (arrival - id) of it.
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
local messages = {}  -- each message read and split into lines once per page: {text, starts}
for _, m in ipairs(members) do
  local a = find(m, '\n', 1, true)
  local b = find(m, '\n', a + 1, true)
  local arrival = sub(m, a - 16, a - 1)
  local payload
  if b == a + 1 then
    payload = redis.call('HGET', ekey, arrival)
  else
    local id = sub(m, a + 1, b - 1)
    local stored = messages[id]
    if stored == nil then
      stored = false
      local got = redis.call('HMGET', ekey, id, 'h' .. id)
      if got[1] then
        local text, starts, at = got[1], {}, tonumber(got[2]) + 1
        while at do
          starts[#starts + 1] = at
          at = find(text, '\n', at, true)
          if at then at = at + 1 end
        end
        stored = {text, starts}
      end
      messages[id] = stored
    end
    if stored then
      local text, starts = stored[1], stored[2]
      local i = tonumber(arrival) - tonumber(id) + 1
      local stop = starts[i + 1]
      payload = sub(text, starts[i], stop and stop - 2 or #text)
    end
  end
  if payload then
    out[#out + 1] = sub(m, 1, a - 1)
    out[#out + 1] = payload
  end
end
return table.concat(out, '\n')
