#!lua
-- Append a batch of events (docs/aep.md "Replay"), in one round trip.
-- KEYS: the session LRU (aep:lru), its write counter (aep:clock), the sessions being evicted
-- (aep:evicting), then four keys per session of the batch, in the order of ARGV[9..]: members
-- (aep:s), events (aep:e), dedupe keys (aep:k), arrival counter (aep:n).
-- ARGV: capacity, max sessions, the events (per event the session number, position and dedupe
-- key, each after its length: big-endian 32-bit, one byte for the position), the fan-out
-- channel or '' (then ARGV[5] is published there), the fan-out message: a header of ARGV[6] bytes,
-- then the payloads of every event of the batch, duplicates too, joined by newlines; the deadline
-- (microseconds of Redis's clock); how the message is published: 'PUBLISH' (one classic channel)
-- or 'SPUBLISH' (on a Redis Cluster, the bucket's shard channel, whose name carries the bucket's
-- tag: the slot of this script's keys); then the batch's sessions.
-- Returns {one '1' (stored) or '0' (duplicate) per event, sessions in the LRU, then sessions
-- evicted whose keys the caller must drop with drop.lua (they are not in this batch)}, or 'late'.
-- An event is a member of aep:s, '<position><arrival>\n<id>\n<dedupe key>', its key in aep:k and
-- its bytes in aep:e: alone under its arrival (<id> empty), or in its batch's message, stored
-- once under <id> (relayd/aep/redis_store.py).
-- Redis runs this for every ingested event (docs/performance.md). The usual batch (one session,
-- no key held or repeated, after every held event) is stored with a few variadic calls for the
-- whole batch, and its message as it came; any other batch takes the per-event loop (three calls
-- per event, three or four more when the session is full). Every string made here costs Redis a
-- pass over its bytes (Lua hashes each one it makes): the message is published and stored as it
-- came, and members are short.
local lru, clock, evicting = KEYS[1], KEYS[2], KEYS[3]
-- Run after the deadline (queued behind a slow command), the append does nothing: the caller has
-- answered "outcome unknown" by then, and its client's retry must be the one copy stored and
-- fanned out (relayd/redis.py Redis.deadline).
local now = redis.call('TIME')
if now[1] * 1000000 + now[2] > tonumber(ARGV[7]) then return 'late' end
-- The first write is one Redis refuses when memory is full (INCR is deny-oom): before Redis 7,
-- which does not read the shebang, a script that has written may go on writing past maxmemory.
redis.call('INCR', clock)
local capacity, max_sessions, blob, message = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[5]
local sub, find, format, unpack = string.sub, string.find, string.format, unpack
local index = {}
for i = 9, #ARGV do
  local base = 3 + 4 * (i - 9)
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

-- Forget trimmed members (their events and dedupe keys): an event stored alone is deleted; one in
-- a batch's message makes that message's count of held events one less, and the message goes
-- with its last event.
local function forget(ekey, kkey, gone)
  local dedupe, fields, shared = {}, {}, {}
  for i, member in ipairs(gone) do
    local a = find(member, '\n', 1, true)
    local b = find(member, '\n', a + 1, true)
    dedupe[i] = sub(member, b + 1)
    if b == a + 1 then
      fields[#fields + 1] = sub(member, a - 16, a - 1)  -- its arrival
    else
      local id = sub(member, a + 1, b - 1)
      shared[id] = (shared[id] or 0) + 1
    end
  end
  each('HDEL', kkey, dedupe, 1, #dedupe)
  for id, n in pairs(shared) do
    if redis.call('HINCRBY', ekey, 'c' .. id, -n) <= 0 then
      fields[#fields + 1] = id
      fields[#fields + 1] = 'c' .. id
      fields[#fields + 1] = 'h' .. id
    end
  end
  each('HDEL', ekey, fields, 1, #fields)
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
if #ARGV == 9 and count > 1 and count <= capacity then
  -- One session, two events or more (one is stored alone), no more than the session holds: is
  -- every key new (not held, not repeated in the batch)?
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
    -- (HMGET, not a set's SMISMEMBER: that needs Redis 6.2.)
    for _, held in ipairs(each('HMGET', kkey, keys, 1, count)) do
      for _, found in ipairs(held) do
        if found then fresh = false end
      end
    end
  end
  local n, id, zargs, arrivals
  if fresh then
    -- The events are stored together, when their message is at most 128 KiB (a replay reads it
    -- whole for each page it answers): the message as it came, under the first one's arrival
    -- (its id), with its count of held events and its header's length. Each member names the
    -- id; its event is the line of the message its arrival is after the id's. A larger batch's
    -- events are stored alone, under their arrivals (then the member's second line is empty).
    n = tonumber(redis.call('GET', nkey) or '0')
    local where = '\n\n'
    if #message <= 131072 then
      id = format('%016d', n + 1)
      where = '\n' .. id .. '\n'
    end
    zargs, arrivals = {}, {}
    for i = 1, count do
      local arrival = format('%016d', n + i)
      arrivals[i] = arrival
      zargs[2 * i - 1] = '0'  -- (a string: a number would be formatted per call)
      zargs[2 * i] = positions[i] .. arrival .. where .. keys[i]
    end
    local top = id and redis.call('ZRANGE', skey, -1, -1)[1]
    each('ZADD', skey, zargs, 1, 2 * count)
    -- A message is kept while any of its events is: only a batch whose events all come after
    -- every held one is stored so, so that the session's events go message by message and at
    -- most one message is held in part (less than a buffer's worth of trimmed bytes). Any other
    -- batch takes the per-event loop.
    if top and redis.call('ZRANGE', skey, -count - 1, -count - 1)[1] ~= top then
      local members = {}
      for i = 1, count do members[i] = zargs[2 * i] end
      each('ZREM', skey, members, 1, count)
      fresh = false
    end
  end
  if fresh then
    -- What the per-event loop does, a call per step for the whole batch: every event is kept,
    -- then the lowest members go down to capacity (the same ones as one at a time, where each
    -- trim drops the lowest of what is held then).
    touch(ARGV[9])
    if id then
      redis.call('HSET', ekey, id, message, 'c' .. id, count, 'h' .. id, ARGV[6])
    else
      local hargs = {}
      for i = 1, count do
        hargs[2 * i - 1], hargs[2 * i] = arrivals[i], sub(message, starts[i], ends[i])
      end
      each('HSET', ekey, hargs, 1, 2 * count)
    end
    local kargs = {}
    for i = 1, count do kargs[2 * i - 1], kargs[2 * i] = keys[i], '' end
    each('HSET', kkey, kargs, 1, 2 * count)
    redis.call('SET', nkey, n + count)
    local over = redis.call('ZCARD', skey) - capacity
    if over > 0 then
      -- (Not ZPOPMIN: it would answer each member's score too, formatted.)
      local gone = redis.call('ZRANGE', skey, 0, over - 1)
      redis.call('ZREMRANGEBYRANK', skey, 0, over - 1)
      forget(ekey, kkey, gone)
    end
    flags = string.rep('1', count)
  end
end

if not flags then
  local out = {}
  local previous = nil
  for i = 1, count do
    local session = ARGV[8 + tonumber(numbers[i])]
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
    if redis.call('HSETNX', kkey, key, '') == 0 then
      out[i] = '0'
    else
      s[1] = s[1] + 1
      -- The event alone, under its arrival (its member's second line is empty).
      local arrival = format('%016d', s[1])
      redis.call('ZADD', skey, '0', positions[i] .. arrival .. '\n\n' .. key)
      redis.call('HSET', ekey, arrival, sub(message, starts[i], ends[i]))
      s[2] = s[2] + 1
      -- Over capacity (by more than one only when the capacity was lowered): the lowest go.
      while s[2] > capacity do
        forget(ekey, kkey, {redis.call('ZPOPMIN', skey)[1]})
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
  -- Live fan-out to the other instances (relayd/aep/redis/fanout.py): the batch is sent to Redis once.
  redis.call(ARGV[8], ARGV[4], message)
end
local reply = {flags, redis.call('ZCARD', lru)}
for _, victim in ipairs(redis.call('ZRANGE', evicting, 0, 63)) do reply[#reply + 1] = victim end
return reply
