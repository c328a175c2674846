-- One more failed console sign-in of a name (projections/sign_ins.py). KEYS[1]: the name's count;
-- ARGV[1]: its window in ms. The count gets an expiry when it has none (its window's first
-- failure), in the same script: no count is ever left without one (a name refused for ever).
local n = redis.call('INCR', KEYS[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return n
