-- Shared by commit.lua and read.lua (prepended to both): the header `n` of a session's state
-- hash (see projections/layout.py) and the chunk names, built as constants (formatting numbers
-- into names at run time costs more than the writes). Upper-case names between at-signs are
-- filled in from projections/layout.py when the scripts are loaded (projections/scripts.py).
local H, CHUNK = KEYS[1], @CHUNK@
local S = @STATE_CHUNKS@
local I = @ID_CHUNKS@
local T = @TIMELINE_CHUNKS@
local ELSEWHERE, WHOLE = string.byte('@ELSEWHERE@'), string.byte('@WHOLE@')

-- The header: (state chunks or WHOLE, id chunks or ELSEWHERE, entry chunks or ELSEWHERE, window).
local function header(n)
  if not n then return 0, 0, 0, 0 end
  local s, i, t = string.byte(n, 1, 3)
  if s ~= WHOLE then s = s - 48 end
  if i ~= ELSEWHERE then i = i - 48 end
  if t ~= ELSEWHERE then t = t - 48 end
  return s, i, t, tonumber(string.sub(n, 4)) or 0
end

local function count(c)
  if c == WHOLE or c == ELSEWHERE then return string.char(c) end
  return string.char(48 + c)
end

-- HMGET names[from .. to] (as many as exist), in order.
local function chunks(names, from, to)
  if to < from then return {} end
  return redis.call('HMGET', H, unpack(names, from, to))
end
