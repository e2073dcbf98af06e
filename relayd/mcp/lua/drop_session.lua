#!lua flags=allow-oom
-- KEYS: inbound and outbound subscriber hashes, inbound and outbound backlogs, correlations,
-- correlation order, pollers index, buffered total, the session's arrival counter, then a queue
-- and its counters per subscriber the caller saw; ARGV: the session, then one '<direction>/<id>' per such queue, in the same order.
-- A subscriber added since the caller looked has no declared queue: nothing is changed and
-- {0} is returned, so the caller looks again. Otherwise {1, direction, id, record, ...}.
local declared = {}
for i = 2, #ARGV do declared[ARGV[i]] = 2 * i + 6 end
local directions = {'inbound', 'outbound'}
local all = {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}
for n = 1, 2 do
  for i = 1, #all[n], 2 do
    if not declared[directions[n] .. '/' .. all[n][i]] then return {0} end
  end
end
local out = {1}
for n = 1, 2 do
  local d = directions[n]
  for i = 1, #all[n], 2 do
    local at = declared[d .. '/' .. all[n][i]]
    release(KEYS[8], tonumber(redis.call('HGET', KEYS[at + 1], 'b') or '0'))
    redis.call('DEL', KEYS[at], KEYS[at + 1])
    redis.call('ZREM', KEYS[7], ARGV[1] .. '/' .. ARGV[(at - 6) / 2])
    out[#out + 1] = d; out[#out + 1] = all[n][i]; out[#out + 1] = all[n][i + 1]
  end
  local backlog = KEYS[2 + n]
  local size = 0
  for _, f in ipairs(redis.call('LRANGE', backlog, 0, -1)) do size = size + #f end
  release(KEYS[8], size)
  redis.call('DEL', KEYS[n], backlog)
end
redis.call('DEL', KEYS[5], KEYS[6], KEYS[9])
return out
