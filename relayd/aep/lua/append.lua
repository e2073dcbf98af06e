-- Append a batch of events (docs/aep.md "Replay"), in one round trip.
-- KEYS: the session LRU (aep:lru), its write counter (aep:clock), the sessions being evicted
-- (aep:evicting), then four keys per session of the batch, in the order of ARGV[4..]: members
-- (aep:s), events (aep:e), dedupe keys (aep:k), arrival counter (aep:n).
-- ARGV: capacity, max sessions, the events (per event four big-endian 32-bit lengths, then the
-- session number, position, dedupe key and payload), the fan-out channel or '' (then every event
-- of the batch, duplicates too, is published there as one message: ARGV[5], then the payloads
-- joined by newlines), the message's header, then the batch's sessions.
-- Returns {one '1' (stored) or '0' (duplicate) per event, sessions in the LRU, then sessions
-- evicted whose keys the caller must drop with drop.lua (they are not in this batch)}.
-- Redis runs this for every ingested event: per event it makes three calls, four more when the
-- session is full (docs/performance.md).
local lru, clock, evicting = KEYS[1], KEYS[2], KEYS[3]
local capacity, max_sessions, blob = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local index = {}
for i = 6, #ARGV do
  local base = 3 + 4 * (i - 6)
  index[ARGV[i]] = base
  -- A session evicted by another batch whose keys are not dropped yet is gone: drop them now.
  if redis.call('ZREM', evicting, ARGV[i]) == 1 then
    redis.call('DEL', KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4])
  end
end
-- Per session of the batch: {arrival counter, member count}, read at its first event and the
-- counter written back at the end.
local state = {}
local flags = {}
local payloads = {}
local at, size = 1, #blob
local previous = nil
while at <= size do
  local a, b, c, d = struct.unpack('>I4I4I4I4', blob, at)
  at = at + 16
  local number = string.sub(blob, at, at + a - 1)
  at = at + a
  local pos = string.sub(blob, at, at + b - 1)
  at = at + b
  local key = string.sub(blob, at, at + c - 1)
  at = at + c
  local payload = string.sub(blob, at, at + d - 1)
  at = at + d
  payloads[#payloads + 1] = payload
  local session = ARGV[5 + tonumber(number)]
  local base = index[session]
  local skey, ekey, kkey = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3]
  -- Recency is refreshed once per run of one session's events: no other session writes between.
  if session ~= previous then
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
    previous = session
  end
  local s = state[base]
  if not s then
    s = {tonumber(redis.call('GET', KEYS[base + 4]) or '0'), redis.call('ZCARD', skey)}
    state[base] = s
  end
  local member = pos .. string.format('%016d', s[1] + 1)
  if redis.call('HSETNX', kkey, key, member) == 0 then
    flags[#flags + 1] = '0'
  else
    s[1] = s[1] + 1
    redis.call('ZADD', skey, 0, member)
    -- The event under its member, and its dedupe key under 'k' .. member (to forget it on a trim).
    redis.call('HSET', ekey, member, payload, 'k' .. member, key)
    s[2] = s[2] + 1
    -- Over capacity (by more than one only when the capacity was lowered): the lowest go.
    while s[2] > capacity do
      local gone = redis.call('ZPOPMIN', skey)[1]
      local key_of = redis.call('HGET', ekey, 'k' .. gone)
      if key_of then redis.call('HDEL', kkey, key_of) end
      redis.call('HDEL', ekey, gone, 'k' .. gone)
      s[2] = s[2] - 1
    end
    flags[#flags + 1] = '1'
  end
end
for base, s in pairs(state) do
  redis.call('SET', KEYS[base + 4], s[1])
end
if ARGV[4] ~= '' then
  -- Live fan-out to the other instances (relayd/aep/redis_fanout.py): the batch is sent to Redis once.
  redis.call('PUBLISH', ARGV[4], ARGV[5] .. table.concat(payloads, '\n'))
end
local out = {table.concat(flags), redis.call('ZCARD', lru)}
for _, victim in ipairs(redis.call('ZRANGE', evicting, 0, 63)) do out[#out + 1] = victim end
return out
