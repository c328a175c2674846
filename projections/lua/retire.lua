-- Restore a retired session from its snapshot stub (a rebuild): its tombstone and what it added
-- to the fleet's counters, not its projection (that expired; `replay --session` folds it whole).
-- KEYS: its partition's tombstones hash, its state hash, then one key per counter hash.
-- ARGV: session id, the tombstone (`<expired ms> <last mark>`), "1" to add the counters to the
-- fleet's, then (key index among KEYS, field, increment)...
-- Returns 1 if written, 0 if the session has a tombstone or a projection already (nothing
-- written: a rebuild restores into cleared keys, so a worker wrote there meanwhile).
local sid = ARGV[1]
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[1], sid, ARGV[2]) == 0 then return 0 end
if ARGV[3] == '1' then
  for at = 4, #ARGV, 3 do
    redis.call('HINCRBY', KEYS[tonumber(ARGV[at])], ARGV[at + 1], ARGV[at + 2])
  end
end
return 1
