"""Which partition a session's events belong to: Kafka's default partitioner, without Kafka.

Every producer of `sessions.events` keys a record by its session id and leaves the partition to
the default (murmur2) partitioner, so a session's events are totally ordered in one partition. The
projections depend on that: a session's high-water mark is a position in that one partition, and
a record found in any other partition is refused, never compared with it. The hash is Kafka's
murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`), written here so that the pure core can
tell the partition without a Kafka client.
"""

from __future__ import annotations

import functools

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash of `data` (an unsigned 32-bit integer)."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    rest = length % 4
    if rest >= 3:
        h ^= data[whole + 2] << 16
    if rest >= 2:
        h ^= data[whole + 1] << 8
    if rest >= 1:
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


@functools.lru_cache(maxsize=1 << 16)
def partition_for(session_id: str, partitions: int) -> int:
    """The partition the default partitioner gives a record keyed by `session_id`."""
    return (murmur2(session_id.encode()) & 0x7FFFFFFF) % partitions
