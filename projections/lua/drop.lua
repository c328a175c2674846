-- Drop one session's projection, and take it out of its partition's waiting index and fleet
-- counts (a rebuild of the session then counts it once). KEYS: its state hash, turns list,
-- timeline list, event-id list, then its partition's waiting zset, cards hash, waiting counts
-- and fleet counts, then its five history lists. ARGV: session id, the prefix of the partition's
-- per-reason zsets.
local sid, rprefix = ARGV[1], ARGV[2]
local was = redis.call('HGET', KEYS[1], 'f')
if was then
  decrement(KEYS[8], status_mode(was))
  local reason = waiting_reason(was)
  if reason then unwait(KEYS[5], KEYS[6], KEYS[7], rprefix, sid, reason) end
end
return redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4], unpack(KEYS, 9, 13))
