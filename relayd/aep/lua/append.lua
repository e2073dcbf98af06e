-- Append a batch of events (docs/aep.md "Replay"), in one round trip.
-- KEYS: the session LRU (aep:lru), its write counter (aep:clock), the sessions being evicted
-- (aep:evicting), then four keys per session of the batch, in the order of ARGV[7..]: members
-- (aep:s), events (aep:e), dedupe keys (aep:k), arrival counter (aep:n).
-- ARGV: capacity, max sessions, the events (per event the session number, position and dedupe
-- key, each after its length: big-endian 32-bit, one byte for the position), the fan-out
-- channel or '' (then ARGV[5] is published there), the fan-out message: a header of ARGV[6] bytes,
-- then the payloads of every event of the batch, duplicates too, joined by newlines; then the
-- batch's sessions.
-- Returns {one '1' (stored) or '0' (duplicate) per event, sessions in the LRU, then sessions
-- evicted whose keys the caller must drop with drop.lua (they are not in this batch)}.
-- Redis runs this for every ingested event (docs/performance.md). The usual batch (one session,
-- no key held or repeated) is stored with a few variadic calls for the whole batch; any other
-- batch takes the per-event loop (three calls per event, three more when the session is full).
-- Every string made here costs Redis a pass over its bytes (Lua hashes each one it makes): the
-- message is published as it came, each payload is cut from it once, members are short.
local lru, clock, evicting = KEYS[1], KEYS[2], KEYS[3]
local capacity, max_sessions, blob, message = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[5]
local sub, find, format, unpack = string.sub, string.find, string.format, unpack
local index = {}
for i = 7, #ARGV do
  local base = 3 + 4 * (i - 7)
  index[ARGV[i]] = base
  -- A session evicted by another batch whose keys are not dropped yet is gone: drop them now.
  if redis.call('ZREM', evicting, ARGV[i]) == 1 then
    redis.call('DEL', KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4])
  end
end
-- Per session of the batch: {arrival counter, member count}, read at its first event and the
-- counter written back at the end.
local state = {}

-- The session's recency (evicting the least recently written sessions to make room for a new one).
local function touch(session)
  if not redis.call('ZSCORE', lru, session) then
    while redis.call('ZCARD', lru) >= max_sessions do
      local victim = redis.call('ZPOPMIN', lru)[1]
      local vbase = index[victim]
      if vbase then
        redis.call('DEL', KEYS[vbase + 1], KEYS[vbase + 2], KEYS[vbase + 3], KEYS[vbase + 4])
        state[vbase] = nil
      else
        redis.call('ZADD', evicting, 0, victim)
      end
    end
  end
  redis.call('ZADD', lru, redis.call('INCR', clock), session)
end

-- The dedupe key of a member: what follows its first line.
local function key_of(member)
  return sub(member, find(member, '\n', 1, true) + 1)
end

-- redis.call(command, key, ...list[from..to]) in calls of at most 1000 arguments (Lua's stack).
local function each(command, key, list, from, to)
  local replies = {}
  while from <= to do
    local last = math.min(from + 999, to)
    replies[#replies + 1] = redis.call(command, key, unpack(list, from, last))
    from = last + 1
  end
  return replies
end

-- The events, parsed once: session number, position, dedupe key, and where the payload lies in
-- the message.
local numbers, positions, keys, starts, ends = {}, {}, {}, {}, {}
local at, size, count, from = 1, #blob, 0, tonumber(ARGV[6]) + 1
local parse = struct.unpack
while at <= size do
  count = count + 1
  local number, position, key
  -- (c0: a string whose length is the integer before it.)
  number, position, key, at = parse('>I4c0Bc0I4c0', blob, at)
  numbers[count], positions[count], keys[count] = number, position, key
  -- The payloads are one line each, joined by line breaks.
  local stop = find(message, '\n', from, true) or #message + 1
  starts[count], ends[count] = from, stop - 1
  from = stop + 1
end

local flags
if #ARGV == 7 and count > 0 then
  -- One session: is every key new (not held, not repeated in the batch)?
  local fresh, seen = true, {}
  for i = 1, count do
    if seen[keys[i]] then
      fresh = false
      break
    end
    seen[keys[i]] = true
  end
  local skey, ekey, kkey, nkey = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
  if fresh then
    for _, held in ipairs(each('SMISMEMBER', kkey, keys, 1, count)) do
      for _, flag in ipairs(held) do
        if flag == 1 then fresh = false end
      end
    end
  end
  if fresh then
    -- What the per-event loop does, a call per step for the whole batch: every event is kept, then
    -- the lowest members go down to capacity (the same ones as one at a time, where each trim
    -- drops the lowest of what is held then).
    touch(ARGV[7])
    local n = tonumber(redis.call('GET', nkey) or '0')
    local zargs, hargs = {}, {}
    for i = 1, count do
      local member = positions[i] .. format('%016d', n + i) .. '\n' .. keys[i]
      zargs[2 * i - 1], zargs[2 * i] = '0', member  -- (a string: a number would be formatted per call)
      hargs[2 * i - 1], hargs[2 * i] = member, sub(message, starts[i], ends[i])
    end
    each('ZADD', skey, zargs, 1, 2 * count)
    each('HSET', ekey, hargs, 1, 2 * count)
    each('SADD', kkey, keys, 1, count)
    redis.call('SET', nkey, n + count)
    local over = redis.call('ZCARD', skey) - capacity
    if over > 0 then
      -- (Not ZPOPMIN: it would answer each member's score too, formatted.)
      local gone = redis.call('ZRANGE', skey, 0, over - 1)
      redis.call('ZREMRANGEBYRANK', skey, 0, over - 1)
      local forget = {}
      for i = 1, #gone do forget[i] = key_of(gone[i]) end
      each('HDEL', ekey, gone, 1, #gone)
      each('SREM', kkey, forget, 1, #forget)
    end
    flags = string.rep('1', count)
  end
end

if not flags then
  local out = {}
  local previous = nil
  for i = 1, count do
    local session = ARGV[6 + tonumber(numbers[i])]
    local base = index[session]
    local skey, ekey, kkey = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3]
    -- Recency is refreshed once per run of one session's events: no other session writes between.
    if session ~= previous then
      touch(session)
      previous = session
    end
    local s = state[base]
    if not s then
      s = {tonumber(redis.call('GET', KEYS[base + 4]) or '0'), redis.call('ZCARD', skey)}
      state[base] = s
    end
    local key = keys[i]
    if redis.call('SADD', kkey, key) == 0 then
      out[i] = '0'
    else
      s[1] = s[1] + 1
      local member = positions[i] .. format('%016d', s[1]) .. '\n' .. key
      redis.call('ZADD', skey, '0', member)
      redis.call('HSET', ekey, member, sub(message, starts[i], ends[i]))
      s[2] = s[2] + 1
      -- Over capacity (by more than one only when the capacity was lowered): the lowest go.
      while s[2] > capacity do
        local gone = redis.call('ZPOPMIN', skey)[1]
        redis.call('HDEL', ekey, gone)
        redis.call('SREM', kkey, key_of(gone))
        s[2] = s[2] - 1
      end
      out[i] = '1'
    end
  end
  for base, s in pairs(state) do
    redis.call('SET', KEYS[base + 4], s[1])
  end
  flags = table.concat(out)
end

if ARGV[4] ~= '' then
  -- Live fan-out to the other instances (relayd/aep/redis_fanout.py): the batch is sent to Redis once.
  redis.call('PUBLISH', ARGV[4], message)
end
local reply = {flags, redis.call('ZCARD', lru)}
for _, victim in ipairs(redis.call('ZRANGE', evicting, 0, 63)) do reply[#reply + 1] = victim end
return reply
