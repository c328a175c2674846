-- Take a restore's mark away if it is still that restore's (another may have set its own since).
-- KEYS: the partition's restoring hash. ARGV: the session id, the mark its restore set.
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
