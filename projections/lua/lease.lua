-- A lease: one holder at a time of a job per prefix (a live rebuild, processors/generations.py).
-- KEYS[1]: the lease key. ARGV: the holder's token, the lease's time to live in ms, and 'take',
-- 'renew' or 'give'. take: the lease becomes this token's if free (or already its own);
-- renew: its time to live starts again if it is this token's; give: it is freed if it is this
-- token's. Returns 1 when that happened, else 0 (another holder has it, or it lapsed).
local holder = redis.call('GET', KEYS[1])
local action = ARGV[3]
if action == 'take' then
  if holder and holder ~= ARGV[1] then return 0 end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder ~= ARGV[1] then return 0 end
if action == 'renew' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif action == 'give' then
  redis.call('DEL', KEYS[1])
else
  return redis.error_reply('lease: unknown action ' .. tostring(action))
end
return 1
