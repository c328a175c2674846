"""Rebuilding projections from the topic: the same fold, the same store, from offset zero.

Run it with the workers stopped (or against a fresh key prefix): a worker committing while a
session is being rebuilt could fold its newest events onto an empty state. The rebuild reads every
partition up to the end offsets it found when it started, in batches, and publishes no decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.partitioner.default import murmur2

from processors.redis_store import RedisProjectionStore
from producers.projector import Projector
from schemas.codec import EventCodec
from schemas.errors import CodecError, LogError
from session_model.projection import BatchFolder, Position, Record
from session_model.signing import TrustedKeys

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a rebuild read and applied."""

    records: int
    applied_sessions: int
    undecodable: int


def partition_for(session_id: str, partitions: int) -> int:
    """The partition the default (murmur2) partitioner gives a session id's key."""
    return int(murmur2(session_id.encode()) & 0x7FFFFFFF) % partitions


def replay(
    bootstrap: str,
    topic: str,
    store: RedisProjectionStore,
    keys: TrustedKeys,
    *,
    session_id: str | None = None,
    batch_size: int = 2000,
    progress: Progress | None = None,
    codec: EventCodec | None = None,
) -> ReplayReport:
    """Drop and rebuild every projection (or one session's) from the topic."""
    codec = codec or EventCodec()
    if session_id is not None:
        # The session's pauses and outcomes are already in the global counters: rebuilding its
        # projection must not count them a second time.
        store = dataclasses.replace(store, count_stats=False)
    # The rebuild owns the sessions it writes: keep their states instead of re-reading them.
    projector = Projector(store, BatchFolder(keys), cache=True)
    try:
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap.split(","),
            enable_auto_commit=False,
            group_id=None,
            max_poll_records=batch_size,
            fetch_max_bytes=64 * 1024 * 1024,
        )
    except KafkaError as e:
        raise LogError(f"cannot reach Kafka at {bootstrap}: {e}") from e
    try:
        partitions = sorted(consumer.partitions_for_topic(topic) or ())
        if not partitions:
            raise LogError(f"topic {topic} does not exist")
        if session_id is not None:
            partitions = [partition_for(session_id, len(partitions))]
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = {tp: off for tp, off in consumer.end_offsets(tps).items() if off > 0}
        total = sum(ends.values())
        if session_id is None:
            store.clear()
        else:
            store.drop(session_id)
        read = undecodable = 0
        applied: set[str] = set()
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            polled = consumer.poll(timeout_ms=1000, max_records=batch_size)
            records: list[Record] = []
            for tp, batch in polled.items():
                for message in batch:
                    if message.offset >= ends.get(tp, 0):
                        continue
                    read += 1
                    if session_id is not None and message.key != session_id.encode():
                        continue
                    try:
                        event = codec.decode(message.value)
                    except CodecError:
                        undecodable += 1  # the live worker dead-lettered it already
                        continue
                    records.append(Record(event, Position(tp.partition, message.offset)))
            if records:
                applied.update(u.session_id for u in projector.project(records))
            if progress is not None:
                progress(read, total)
        return ReplayReport(read, len(applied), undecodable)
    except KafkaError as e:
        raise LogError(f"reading {topic} failed: {e}") from e
    finally:
        consumer.close()
