-- Shared by the scripts that remove frames (prepended to them): the buffered-bytes counter never
-- goes below zero (frames stored before the counter existed are released without ever having
-- been counted).
local function release(buffered, n)
  if n > 0 and redis.call('DECRBY', buffered, n) < 0 then
    redis.call('SET', buffered, 0)
  end
end
