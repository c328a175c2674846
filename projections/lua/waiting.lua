-- One page of a partition's waiting questions. KEYS: a waiting zset (all reasons, or one) and
-- the partition's cards hash. ARGV: min score ("-inf" for the first page), the cursor's session
-- id ("" = none: members at the min score are not skipped), limit.
-- Returns {total, {member, score, card, member, score, card, ...}}, soonest deadline first; a
-- member at the cursor's score sorts after the cursor iff its id is greater (ZRANGE's order).
local zset, cards = KEYS[1], KEYS[2]
local min, after, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local at = tonumber(min)
local out, offset = {}, 0
local found = 0
while found < limit do
  local batch = redis.call('ZRANGE', zset, min, '+inf', 'BYSCORE', 'LIMIT', offset, limit,
                           'WITHSCORES')
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    local member, score = batch[i], batch[i + 1]
    if after == '' or tonumber(score) ~= at or member > after then
      found = found + 1
      out[#out + 1] = member
      out[#out + 1] = score
      out[#out + 1] = redis.call('HGET', cards, member) or ''
      if found >= limit then break end
    end
  end
  offset = offset + #batch / 2
end
return {redis.call('ZCARD', zset), out}
