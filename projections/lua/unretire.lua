-- Take retired entries whose stubs were acknowledged out of a partition's retired hash, each only
-- if it is still the entry the round read (a session restored and expired again meanwhile left
-- a newer one, whose stub is still to be written). KEYS[1]: the retired hash. ARGV: (session id,
-- entry as read)...
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return 0
