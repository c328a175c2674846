-- Drop one session's projection, and take it out of every index of its partition that names it:
-- the waiting index and fleet counts (a rebuild of the session then counts it once), the
-- retention and unsnapshotted indexes, the deadlines and the compaction-due set (the scheduler
-- would read a dropped session again at every poll). KEYS: its state hash, turns list,
-- timeline list, event-id list, then its partition's waiting zset, cards hash, waiting counts
-- and fleet counts, then its five history lists, then its partition's retention zset and
-- tombstones hash, its partition's unsnapshotted zset, deadlines zset and compaction-due set, and
-- its partition's retired hash.
-- ARGV: session id, the prefix of the partition's per-reason zsets, now ms, "1" to hold it in
-- the unsnapshotted index at offset 0 instead of taking it out (a restore follows: no
-- checkpoint may pass its events before a snapshot of it, whole again, is taken), and "1" to
-- retire it when it expires (snapshots are taken), and (the sweep) its partition's settled
-- offset ("": none), before which everything applied has what it made published, and "1" to
-- keep its tombstone (a restore follows, whose first commit takes it away: a worker's commit of
-- it meanwhile finds it expired, instead of writing it from nothing).
-- Without now ("", a rebuild follows): drop it and forget its retention entry, tombstone (unless
-- kept) and retired entry; returns how many keys were unlinked. With now (the retention sweep): only if
-- its retention deadline is at or before now, drop it and leave a tombstone `<now> <last mark>`
-- (and, retiring, a retired entry `<now> <last mark> <its counters as JSON>`, which the next
-- snapshot round replaces its snapshot with a stub by); returns 1 if it was dropped, else 0
-- (restored meanwhile, expired by another sweep already, or its last state not in a snapshot
-- yet, or its last event not below the settled offset: then its deadline moves a minute on).
local sid, rprefix, now, hold, retire = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1'
local settled, keep_tombstone = ARGV[6], ARGV[7] == '1'
if now ~= '' then
  local due = redis.call('ZSCORE', KEYS[14], sid)
  if not due or tonumber(due) > tonumber(now) then return 0 end
  -- Not before what its last batch made (decisions, question changes) is published: dropped
  -- first, a redelivery of that batch would find a tombstone, and publish nothing.
  if settled and settled ~= '' then
    local mark = redis.call('HGET', KEYS[1], 'mark')
    local offset = mark and tonumber(string.match(mark, ':(%d+)$'))
    if offset and offset >= tonumber(settled) then
      redis.call('ZADD', KEYS[14], 'XX', tonumber(now) + 60000, sid)
      return 0
    end
  end
  -- Not before its last state is in a snapshot: a rebuild from snapshots would miss it. Looked
  -- at again in a minute: the sweep reads the earliest due first, and sessions waiting for a
  -- snapshot (or too large for one) must not keep it from those due after them.
  if redis.call('ZSCORE', KEYS[16], sid) then
    redis.call('ZADD', KEYS[14], 'XX', tonumber(now) + 60000, sid)
    return 0
  end
end
local got = redis.call('HMGET', KEYS[1], 'f', 'mark')
local counters = nil
if retire and now ~= '' and got[2] then
  -- Its own counters: the `c:` fields (the names, then their values: not the state's chunks).
  counters = {}
  local names = {}
  for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(f, 1, 2) == 'c:' then names[#names + 1] = f end
  end
  if #names > 0 then
    local values = redis.call('HMGET', KEYS[1], unpack(names))
    for i, f in ipairs(names) do counters[string.sub(f, 3)] = tonumber(values[i]) end
  end
end
local was = got[1]
if was then
  decrement(KEYS[8], status_mode(was))
  local reason = waiting_reason(was)
  if reason then unwait(KEYS[5], KEYS[6], KEYS[7], rprefix, sid, reason) end
end
redis.call('ZREM', KEYS[14], sid)
if hold == '1' and now == '' then
  redis.call('ZADD', KEYS[16], 0, sid)
else
  redis.call('ZREM', KEYS[16], sid)
end
redis.call('ZREM', KEYS[17], sid)
redis.call('SREM', KEYS[18], sid)
local unlinked = redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4], unpack(KEYS, 9, 13))
if now == '' then
  if not keep_tombstone then redis.call('HDEL', KEYS[15], sid) end
  redis.call('HDEL', KEYS[19], sid)
  return unlinked
end
if not got[2] then return 0 end  -- nothing was projected: nothing expired
redis.call('HSET', KEYS[15], sid, now .. ' ' .. got[2])
if counters then
  -- cjson writes an empty table as {} and a number with 14 significant digits: exact for
  -- counts below 10^14.
  redis.call('HSET', KEYS[19], sid, now .. ' ' .. got[2] .. ' ' .. cjson.encode(counters))
end
return 1
