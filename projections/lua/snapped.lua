-- After a partition's snapshots were acknowledged: take the sessions they cover out of the
-- partition's unsnapshotted index. KEYS: the unsnapshotted zset, then per session its state hash.
-- ARGV: per session, in order: session id, the snapshot's mark ("": it had no state to snapshot),
-- the offset after it.
-- A session committed again since its state was read stays in the index, from the offset after
-- its snapshot. Returns the lowest offset still in the index (false: none), from which on the
-- partition is not covered by snapshots.
local index = KEYS[1]
for s = 1, #KEYS - 1 do
  local sid, mark, after = ARGV[3 * s - 2], ARGV[3 * s - 1], ARGV[3 * s]
  local stored = redis.call('HGET', KEYS[s + 1], 'mark')
  if stored == mark or (not stored and mark == '') then
    redis.call('ZREM', index, sid)
  else
    redis.call('ZADD', index, 'XX', 'GT', after, sid)
  end
end
local low = redis.call('ZRANGE', index, 0, 0, 'WITHSCORES')
if #low == 0 then return false end
return low[2]
