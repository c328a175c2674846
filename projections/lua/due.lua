-- Due work of one partition. KEYS: its deadlines zset and compaction-due set. ARGV[1]: until
-- (epoch ms or "+inf"). A flat reply (member, score, member, score, ...) paired by the caller:
-- redis-py's per-pair conversion of ZRANGEBYSCORE ... WITHSCORES was most of a scheduler poll's
-- time on the event loop.
return {redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES'),
        redis.call('SMEMBERS', KEYS[2])}
