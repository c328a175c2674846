-- A live rebuild moves one partition to its new generation (processors/generations.py).
-- KEYS[1]: the partition's generation hash. ARGV: the generation it must be in now, the new one.
-- Atomic with the commit script's calls of the partition (the same slot): the move happens only
-- if the new generation has committed at least as far in the partition as the current one, so
-- nothing the current one holds is missing from the new one; from then on commits in the old
-- generation are refused (they answer 3) and their writers read the generations again.
-- Returns 1 (moved), 0 (the current generation is ahead: catch up and try again) or -1 (the
-- partition is not in the expected generation).
local current = tonumber(redis.call('HGET', KEYS[1], 'g') or '0')
if current ~= tonumber(ARGV[1]) then return -1 end
local old = tonumber(redis.call('HGET', KEYS[1], 'a' .. ARGV[1]) or '-1')
local new = tonumber(redis.call('HGET', KEYS[1], 'a' .. ARGV[2]) or '-1')
if old > new then return 0 end
redis.call('HSET', KEYS[1], 'g', ARGV[2])
redis.call('HDEL', KEYS[1], 'a' .. ARGV[1])
return 1
