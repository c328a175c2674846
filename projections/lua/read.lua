-- Reads sessions' folded state (header.lua is prepended).
-- KEYS: per session, in order: state hash, turns list, event-id list. ARGV[1]: "1" to read the
-- event ids too. Returns per session, in order: false (unknown) or {state blob ("" if none of this
-- layout), mark, turns, the recent event ids as packed dedupe chunks, the current one last,
-- the summary (false: none)}.
local out = {}
for ko = 0, #KEYS - 1, 3 do
  H = KEYS[ko + 1]
  local got = redis.call('HMGET', H, 'mark', 'n', 's', 'm')
  if not got[1] then
    out[#out + 1] = false
  elseif not got[2] then
    out[#out + 1] = {'', got[1], {}, {}, false}
  else
    local sc, ic, tc, window = header(got[2])
    local state = got[3]
    if sc ~= WHOLE then state = table.concat(chunks(S, 1, sc)) end
    local turns = {}
    if window > 0 then turns = redis.call('LRANGE', KEYS[ko + 2], -window, -1) end
    local ids = {}
    if ARGV[1] == '1' then
      if ic == ELSEWHERE then
        ids = redis.call('LRANGE', KEYS[ko + 3], 0, -1)
      elseif ic > 0 then
        ids = {table.concat(chunks(I, 1, ic))}
      end
    end
    out[#out + 1] = {state, got[1], turns, ids, got[4]}
  end
end
return out
