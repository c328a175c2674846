-- The commit of a group of sessions of one partition (header.lua is prepended).
-- KEYS[1] and ARGV[1]: the partition's generation hash and the generation the other keys are in.
-- Then KEYS: per session, in order: state hash, turns list, timeline list, event-id list, deadlines
--       zset, compaction-due set, then its partition's waiting zset, waiting cards hash, waiting
--       counts hash and fleet counts hash, then its history lists (calls, observations,
--       executions, decisions, rejections), then its partition's retention zset and tombstones
--       hash, its partition's unsnapshotted zset, then one key per counter hash.
-- Then ARGV: per session, in order: its number of KEYS, its number of arguments, then its arguments:
--       base mark ("" = none), new mark, state blob, window, session id, deadline ms ("" = none),
--       compaction due ("1"/"0"), the summary ("" = unchanged, else "=" and the text; field m
--       of the state hash), the new event ids (packed) of the dedupe chunk the stored ids
--       end in ("head"), n_groups, the new ids of each later chunk (packed)..., n_turns,
--       turns..., n_tl, entries..., n_counters, (key index among the session's KEYS, field,
--       increment, the session's own field for it)..., then the fleet entry (lua/index.lua),
--       the waiting card ("" = not waiting), its score and the prefix of the partition's
--       per-reason zsets (same hash tag as the waiting zset), the retention deadline ms ("" =
--       none: not ended, or no TTL), "1" to add the counters to the fleet's, "1" to add them to
--       the session's own (fields `c:<counter>` of its state hash, while snapshots are taken:
--       a field, not a key, so an idle session stays one small hash), the first offset
--       applied ("" = not tracked: snapshots are not taken),
--       then n_hist, (key index among the session's KEYS, n, entries...)..., then "1" to restore
--       (`replay --session`: a tombstone does not refuse the commit, which takes it away).
-- Event ids (session_model/dedupe.py): while the session is compact they are inline and all in
-- the first dedupe chunk; once spread, the id list holds one element per chunk, the last
-- @KEPT_GROUPS@ only.
-- A session without a mark that has a tombstone expired (retention): nothing is written for it
-- (its events stay in Kafka; `replay --session` rebuilds it whole: its commits carry a last
-- argument "1", restore, which a tombstone does not refuse and which takes the tombstone away).
-- Returns one 1 (applied), 0 (conflict: nothing written) or 2 (expired: nothing written) per
-- session, in order. The counters of
-- the sessions applied are summed and written once per (key, field) at the end.
local acc = {}  -- counter key -> field -> increment, over the sessions applied

-- RPUSH items[first .. first + count - 1] to `key`, in slices Lua can unpack.
local function push(key, items, first, count)
  for j = first, first + count - 1, 4000 do
    redis.call('RPUSH', key, unpack(items, j, math.min(j + 3999, first + count - 1)))
  end
end

-- The history lists: n_hist groups of (key index, count, entries...) from ARGV[at].
local function push_history(ko, at)
  local n_hist = tonumber(ARGV[at])
  at = at + 1
  for _ = 1, n_hist do
    local n = tonumber(ARGV[at + 1])
    push(KEYS[ko + tonumber(ARGV[at])], ARGV, at + 2, n)
    at = at + 2 + n
  end
end

-- Spread: the new ids onto the id list (one element per dedupe chunk), the last ones kept.
local function push_ids(key, head, groups_at, n_groups)
  if #head > 0 then
    redis.call('LSET', key, -1, (redis.call('LINDEX', key, -1) or '') .. head)
  end
  if n_groups > 0 then
    push(key, ARGV, groups_at, n_groups)
    redis.call('LTRIM', key, -@KEPT_GROUPS@, -1)
  end
end

local function push_entries(key, text)  -- entries, each ended by a newline
  local all = {}
  for entry in string.gmatch(text, '([^\n]*)\n') do all[#all + 1] = entry end
  push(key, all, 1, #all)
end

-- The fleet entry and the waiting index of one session, changed only where they differ from what
-- its state hash recorded (`was`: field f), so a rebuild counts nothing twice. Returns the entry
-- to record, or nil when it is unchanged.
local function waiting(ko, sid, at, was)
  local entry, card, score, rprefix = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  local counts = KEYS[ko + 9]
  local old = was and waiting_reason(was)
  if card ~= '' then
    local reason = waiting_reason(entry)
    if old and old ~= reason then
      if redis.call('ZREM', rprefix .. old, sid) == 1 then decrement(counts, old) end
    end
    redis.call('HSET', KEYS[ko + 8], sid, card)
    redis.call('ZADD', KEYS[ko + 7], score, sid)
    if redis.call('ZADD', rprefix .. reason, score, sid) == 1 then
      redis.call('HINCRBY', counts, reason, 1)
    end
  elseif old then
    unwait(KEYS[ko + 7], KEYS[ko + 8], counts, rprefix, sid, old)
  end
  if was == entry then return nil end
  local fleet = KEYS[ko + 10]
  if was then decrement(fleet, status_mode(was)) end
  redis.call('HINCRBY', fleet, status_mode(entry), 1)
  return entry
end

-- One session: its KEYS start after `ko`, its arguments after `ao`; `restore`: its last one.
local function commit(ko, ao, restore)
  H = KEYS[ko + 1]
  local state, window, summary, head = ARGV[ao + 3], ARGV[ao + 4], ARGV[ao + 8], ARGV[ao + 9]
  local n_groups = tonumber(ARGV[ao + 10])
  local groups_at = ao + 11
  local turns_at = groups_at + n_groups + 1
  local n_turns = tonumber(ARGV[turns_at - 1])
  local tl_at = turns_at + n_turns + 1
  local n_tl = tonumber(ARGV[tl_at - 1])
  local counters_at = tl_at + n_tl
  if window == '0' then window = '' end

  local got = redis.call('HMGET', H, 'mark', 'n', 'f')
  if (got[1] or '') ~= ARGV[ao + 1] then return 0 end
  if not got[1] and redis.call('HEXISTS', KEYS[ko + 17], ARGV[ao + 5]) == 1 then
    if restore ~= '1' then return 2 end
    redis.call('HDEL', KEYS[ko + 17], ARGV[ao + 5])
  end
  local sc, ic, tc = header(got[2])
  local set, del = {'mark', ARGV[ao + 2]}, {}

  local function put_chunks(names, k, data)  -- data into names[k + 1], names[k + 2], ...
    for p = 1, #data, CHUNK do
      k = k + 1
      set[#set + 1] = names[k]
      set[#set + 1] = string.sub(data, p, p + CHUNK - 1)
    end
    return k
  end

  local function drop(names, from, to)
    for k = from, to do del[#del + 1] = names[k] end
  end

  -- Append `data` to the inline stream of `n` chunks whose last one is `last`.
  local function append(names, n, last, data)
    if n > 0 and #last < CHUNK then
      return put_chunks(names, n - 1, last .. data)
    end
    return put_chunks(names, n, data)
  end

  if ic == ELSEWHERE then
    -- Spread: the state whole, the ids and the timeline in keys of their own.
    push_ids(KEYS[ko + 4], head, groups_at, n_groups)
    if n_tl > 0 then push(KEYS[ko + 3], ARGV, tl_at, n_tl) end
    set[#set + 1] = 's'
    set[#set + 1] = state
    sc = WHOLE
  else
    -- Inline ids are those of the first dedupe chunk only: ids of a later chunk spread the session.
    local ids, spread = head, n_groups > 1 or (n_groups == 1 and ic > 0)
    if n_groups == 1 and ic == 0 then ids = ARGV[groups_at] end
    local new_tl = {}
    for j = tl_at, tl_at + n_tl - 1 do
      new_tl[#new_tl + 1] = ARGV[j]
      new_tl[#new_tl + 1] = '\n'
    end
    new_tl = table.concat(new_tl)
    -- The last chunk of each stream appended to.
    local want = {}
    if #ids > 0 and not spread and ic > 0 then want[#want + 1] = I[ic] end
    if #new_tl > 0 and tc ~= ELSEWHERE and tc > 0 then want[#want + 1] = T[tc] end
    local last = {}
    if #want > 0 then
      local values = redis.call('HMGET', H, unpack(want))
      for k = 1, #want do last[want[k]] = values[k] end
    end
    local id_last = ic > 0 and last[I[ic]] or ''
    if spread or (ic > 0 and (ic - 1) * CHUNK + #(id_last or '') or 0) + #ids > @IDS_INLINE@ then
      -- Too many events: spread the session out, for good.
      local first = table.concat(chunks(I, 1, ic)) .. head
      if n_groups == 1 and ic == 0 then
        first = ids
        n_groups = 0
      end
      if #first > 0 then redis.call('RPUSH', KEYS[ko + 4], first) end
      push_ids(KEYS[ko + 4], '', groups_at, n_groups)
      drop(I, 1, ic)
      ic = ELSEWHERE
      if tc ~= ELSEWHERE then
        push_entries(KEYS[ko + 3], table.concat(chunks(T, 1, tc)))
        drop(T, 1, tc)
        tc = ELSEWHERE
      end
      if n_tl > 0 then push(KEYS[ko + 3], ARGV, tl_at, n_tl) end
    else
      if #ids > 0 then ic = append(I, ic, id_last, ids) end
      if #new_tl > 0 then
        if tc == ELSEWHERE then
          push(KEYS[ko + 3], ARGV, tl_at, n_tl)
        else
          local tl_last = tc > 0 and last[T[tc]] or ''
          if (tc > 0 and (tc - 1) * CHUNK + #tl_last or 0) + #new_tl > @TIMELINE_INLINE@ then
            push_entries(KEYS[ko + 3], table.concat(chunks(T, 1, tc)) .. new_tl)
            drop(T, 1, tc)
            tc = ELSEWHERE
          else
            tc = append(T, tc, tl_last, new_tl)
          end
        end
      end
    end
    local before = sc
    if ic ~= ELSEWHERE and #state <= @STATE_INLINE@ then
      sc = put_chunks(S, 0, state)
      if before == WHOLE then
        del[#del + 1] = 's'
      else
        drop(S, sc + 1, before)
      end
    else
      set[#set + 1] = 's'
      set[#set + 1] = state
      if before ~= WHOLE then drop(S, 1, before) end
      sc = WHOLE
    end
  end
  if #summary > 0 then
    set[#set + 1] = 'm'
    set[#set + 1] = string.sub(summary, 2)
  end
  set[#set + 1] = 'n'
  set[#set + 1] = count(sc) .. count(ic) .. count(tc) .. window
  local sid = ARGV[ao + 5]
  local n_counters = tonumber(ARGV[counters_at])
  local entry = waiting(ko, sid, counters_at + 1 + n_counters * 4, got[3])
  if entry then
    set[#set + 1] = 'f'
    set[#set + 1] = entry
  end
  if #del > 0 then redis.call('HDEL', H, unpack(del)) end
  redis.call('HSET', H, unpack(set))
  if n_turns > 0 then push(KEYS[ko + 2], ARGV, turns_at, n_turns) end
  local retain_at = counters_at + 1 + n_counters * 4 + 4
  push_history(ko, retain_at + 4)
  if ARGV[retain_at + 3] ~= '' then
    -- NX: the first offset applied since the session's latest snapshot stays until the next one.
    redis.call('ZADD', KEYS[ko + 18], 'NX', ARGV[retain_at + 3], sid)
  end
  if ARGV[retain_at] ~= '' then
    -- GT: a later event of the ended session, or a restore's floor, only ever extends it.
    redis.call('ZADD', KEYS[ko + 16], 'GT', ARGV[retain_at], sid)
  end
  if ARGV[ao + 6] == '' then
    redis.call('ZREM', KEYS[ko + 5], sid)
  else
    redis.call('ZADD', KEYS[ko + 5], ARGV[ao + 6], sid)
  end
  if ARGV[ao + 7] == '1' then
    redis.call('SADD', KEYS[ko + 6], sid)
  else
    redis.call('SREM', KEYS[ko + 6], sid)
  end
  local fleet_wide, mine, own = ARGV[retain_at + 1] == '1', ARGV[retain_at + 2] == '1', {}
  for c = 1, n_counters do
    local base = counters_at + (c - 1) * 4
    local n = tonumber(ARGV[base + 3])
    if mine then own[ARGV[base + 4]] = (own[ARGV[base + 4]] or 0) + n end
    if fleet_wide then
      local key, f = KEYS[ko + tonumber(ARGV[base + 1])], ARGV[base + 2]
      local fields = acc[key]
      if not fields then
        fields = {}
        acc[key] = fields
      end
      fields[f] = (fields[f] or 0) + n
    end
  end
  for f, n in pairs(own) do redis.call('HINCRBY', H, 'c:' .. f, n) end
  return 1
end

-- KEYS[1], ARGV[1]: the partition's generation hash and the generation these keys are in. A
-- partition a live rebuild moved to a newer generation takes no more writes in an older one:
-- every session answers 3 and the writer reads the generations again.
local generations, mine = KEYS[1], tonumber(ARGV[1])
local current = tonumber(redis.call('HGET', generations, 'g') or '0')
local applied, ko, ao = {}, 1, 1
if mine < current then
  while ao < #ARGV do
    applied[#applied + 1] = 3
    ko = ko + tonumber(ARGV[ao + 1])
    ao = ao + 2 + tonumber(ARGV[ao + 2])
  end
  return applied
end
local top = -1  -- the highest offset this call committed, for the switch's comparison
while ao < #ARGV do
  local n_keys, n_args = tonumber(ARGV[ao + 1]), tonumber(ARGV[ao + 2])
  local done = commit(ko, ao + 2, ARGV[ao + 2 + n_args])
  applied[#applied + 1] = done
  if done == 1 then
    local offset = tonumber(string.match(ARGV[ao + 4], ':(%d+)$'))
    if offset > top then top = offset end
  end
  ko = ko + n_keys
  ao = ao + 2 + n_args
end
for key, fields in pairs(acc) do
  for f, n in pairs(fields) do redis.call('HINCRBY', key, f, n) end
end
if top >= 0 then
  local field = 'a' .. mine
  if top > tonumber(redis.call('HGET', generations, field) or '-1') then
    redis.call('HSET', generations, field, top)
  end
end
return applied
