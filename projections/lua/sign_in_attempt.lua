-- One more console sign-in attempt of a bucket (a name's, or a client address's:
-- projections/sign_ins.py), counted before its password is checked. KEYS[1]: the bucket's count;
-- ARGV[1]: its window in ms. The count gets an expiry when it has none (its window's first
-- attempt), in the same script: no count is ever left without one (a name or an address refused
-- for ever). Returns {attempts, ms left of the window}.
local n = redis.call('INCR', KEYS[1])
local left = redis.call('PTTL', KEYS[1])
if left < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  left = tonumber(ARGV[1])
end
return {n, left}
