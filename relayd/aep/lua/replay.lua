#!lua flags=no-writes
-- A replay, or one page of it: {the earliest member's position and arrival, the next page's
-- cursor (the last member's position and arrival) or '', then the events' bytes in runs: each run
-- one string of one or more events joined by line breaks}, or '' when the session holds none.
-- KEYS: the session's members (aep:s) and events (aep:e), the sessions being evicted
-- (aep:evicting); ARGV: the session, the lowest member (ZRANGEBYLEX form), the page size (0: all).
-- A member is '<position><arrival>\n<id>\n<dedupe key>' (append.lua): <id> is empty for an event
-- stored alone under its arrival, else the arrival under which its batch's message is stored
-- (after a header whose length is under 'h' .. id): the event is its line (arrival - id) of it.
-- Events that follow one another in a message are answered as one run cut from it (each string
-- made here costs a pass over its bytes), and the runs are not joined (nor is the reply).
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
local run, run_id, run_start, run_stop, run_index = nil, nil, nil, nil, nil  -- the run being cut
local function flush()
  if run then out[#out + 1] = sub(run, run_start, run_stop) end
  run = nil
end
for _, m in ipairs(members) do
  local a = find(m, '\n', 1, true)
  local b = find(m, '\n', a + 1, true)
  local arrival = sub(m, a - 16, a - 1)
  if b == a + 1 then
    local payload = redis.call('HGET', ekey, arrival)
    if payload then
      flush()
      out[#out + 1] = payload
    end
  else
    local id = sub(m, a + 1, b - 1)
    local stored = messages[id]
    if stored == nil then
      stored = false
      local got = redis.call('HMGET', ekey, id, 'h' .. id)
      if got[1] then
        local text, starts, at = got[1], {}, (tonumber(got[2]) or 0) + 1
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
      stop = stop and stop - 2 or #text
      if run and run_id == id and i == run_index + 1 then
        run_stop, run_index = stop, i
      else
        flush()
        run, run_id, run_start, run_stop, run_index = text, id, starts[i], stop, i
      end
    end
  end
end
flush()
return out
