-- Shared by commit.lua and drop.lua (prepended to both): a session's entry in its partition's
-- waiting index and fleet counts. The entry (the state hash's field f: a status letter, a mode
-- letter, then the reason while it waits, `projections/cards.py`) says what the session counts
-- as; counts drop a field at zero, so a rebuild leaves the same.

local function decrement(key, field)
  if redis.call('HINCRBY', key, field, -1) <= 0 then redis.call('HDEL', key, field) end
end

local function status_mode(entry)
  return string.sub(entry, 1, 2)
end

-- The reason a session waits for, or nil when its entry is not `waiting`.
local function waiting_reason(entry)
  if string.byte(entry, 1) == 119 then return string.sub(entry, 3) end  -- 'w'
  return nil
end

-- Take a session out of the waiting index (zset, cards, its reason's zset and count).
local function unwait(zset, cards, counts, rprefix, sid, reason)
  redis.call('HDEL', cards, sid)
  redis.call('ZREM', zset, sid)
  if redis.call('ZREM', rprefix .. reason, sid) == 1 then decrement(counts, reason) end
end

